"""The one adapter-name rule and adapter file list (adapters/store.py), shared by the
offline store, the serve config and the tenant catalog."""

import pytest

from loraplex.adapters import peft_format, store
from loraplex.deployments import catalog


@pytest.mark.parametrize("name", ["a", "French_v2.1", "0-x", "a" * 64])
def test_valid_names(name):
    assert store.ADAPTER_NAME.match(name)


@pytest.mark.parametrize("name", ["", "a" * 65, ".hidden", "-x", "a/b", "../up", "a b", "é"])
def test_invalid_names(name):
    assert not store.ADAPTER_NAME.match(name)


def test_every_layer_uses_the_same_rule_and_files():
    assert store.ADAPTER_FILES == (peft_format.CONFIG_NAME, peft_format.WEIGHTS_NAME)
    assert catalog.ADAPTER_NAME is store.ADAPTER_NAME
    assert catalog.ADAPTER_FILES is store.ADAPTER_FILES
