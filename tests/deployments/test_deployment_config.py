"""The serve config's model section: engine options parsed once at the edge, the
speculative section as a YAML mapping or its JSON text, bad values named."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from loraplex.deployments.config import ModelDeploymentConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def model_section(tiny_folder, engine_yaml: str) -> ModelDeploymentConfig:
    document = f"name: tiny\nmodel: {tiny_folder}\nengine:\n{engine_yaml}"
    return ModelDeploymentConfig.model_validate(yaml.safe_load(document))


def test_speculative_config_as_a_yaml_mapping_or_json_text(tiny_model_factory):
    folder = tiny_model_factory("llama")
    mapping = model_section(
        folder,
        "  speculative_config:\n    method: ngram\n    num_speculative_tokens: 3\n"
        "    prompt_lookup_max: 3\n",
    )
    text = model_section(
        folder,
        '  speculative_config: \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 3}\'\n',
    )
    for config in (mapping, text):
        speculative = config.engine_config().speculative
        assert speculative.enabled and speculative.num_speculative_tokens == 3
        assert speculative.prompt_lookup_max == 3
    assert mapping.engine_config() == text.engine_config()


@pytest.mark.parametrize(
    "engine_yaml, named",
    [
        ("  speculative_config:\n    method: eagle\n    num_speculative_tokens: 3\n", "method"),
        ("  speculative_config:\n    method: ngram\n", "num_speculative_tokens"),
        (
            "  speculative_config:\n    method: ngram\n    draft: x\n    num_speculative_tokens: 2\n",
            "draft",
        ),
        ("  max_num_seqs:\n    a: 1\n", "max_num_seqs"),
        ("  speculative_config:\n    method:\n      nested: 1\n", "speculative_config"),
    ],
)
def test_bad_engine_mappings_are_refused_naming_the_option(tiny_model_factory, engine_yaml, named):
    with pytest.raises(ValidationError, match=named):
        model_section(tiny_model_factory("llama"), engine_yaml)
