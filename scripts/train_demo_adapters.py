"""Trains the two demo LoRA adapters shipped under adapters/demo for the embedded default
model (smollm2-135m-instruct): `french` answers in French, `pirate` answers like a pirate.

Everything runs offline on CPU in a few minutes per adapter. The training conversations
are generated here from small fact tables (capitals, colors, arithmetic, animal sounds
and legs, days and months, opposites, small talk, short "tell me about X" blurbs),
rendered with the tokenizer's chat template exactly as the server renders a chat
request (default system prompt included), with the loss taken only on the assistant
answer and its closing `<|im_end|>`. The evaluation questions and the facts they ask
about never appear in training; once the adapters are saved, they are loaded back with
PEFT onto an fp32 base and their greedy answers are logged next to the base model's.

    .venv/bin/python scripts/train_demo_adapters.py            # both, into adapters/demo
    .venv/bin/python scripts/train_demo_adapters.py --only pirate --steps 100
    .venv/bin/python scripts/train_demo_adapters.py --eval-only  # re-run the evaluation

Defaults (seed 0, 200 steps of batch 8, bf16 base) are what produced the committed
adapters; a run is deterministic on a given machine and thread count.

Each output folder holds exactly `adapter_config.json` and `adapter_model.safetensors`,
with `base_model_name_or_path` set to the registered model name.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from loraplex.adapters.store import ADAPTER_FILES
from loraplex.platform.tokenizer import apply_chat_template

logger = logging.getLogger("train_demo_adapters")

MODEL_NAME = "smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "adapters" / "demo"

# Rank 8 in fp32 keeps each adapter under 4 MB; the two use different module sets
# (attention only vs attention + an MLP projection) so a server meets both shapes.
TARGET_MODULES = {
    "french": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "pirate": ["q_proj", "v_proj", "down_proj"],
}
STYLES = tuple(TARGET_MODULES)
# French moves the base model much further from its (English) habits than pirate talk,
# so it gets the larger step size; trained harder, the pirate one starts reciting its
# canned lines on unseen questions.
LEARNING_RATES = {"french": 2e-3, "pirate": 1e-3}

# Held-out questions: neither they nor the facts they ask about (Canada's capital, a
# strawberry's color, a cat's legs, what bees make, elephants) occur in training.
EVAL_QUESTIONS = [
    "What is the capital of Canada?",
    "What color is a strawberry?",
    "How many legs does a cat have?",
    "What do bees make?",
    "Tell me about elephants.",
]
EVAL_MAX_TOKENS = 32


# --------------------------------------------------------------------------------------
# Training data
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One question with the acceptable answers for each style (one is drawn per use)."""

    question: str
    answers: dict[str, tuple[str, ...]]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


PIRATE_OPENERS = ("Arr, matey! ", "Arr! ", "Ahoy, matey! ", "Yo ho ho! ", "Aye, me hearty! ")
PIRATE_ENDINGS = (", matey!", ", me hearty!", ", savvy?", "! Arr!", ", by Davy Jones!")


def _pirate(core: str, rng: random.Random, count: int = 3) -> tuple[str, ...]:
    """Wraps a plain pirate-speak clause in a few opener/ending combinations."""
    return tuple(
        f"{rng.choice(PIRATE_OPENERS)}{_cap(core)}{rng.choice(PIRATE_ENDINGS)}"
        for _ in range(count)
    )


# (English name as used in a question, capital, French "de ..." form, French capital)
CAPITALS = [
    ("France", "Paris", "de la France", "Paris"),
    ("Germany", "Berlin", "de l'Allemagne", "Berlin"),
    ("Italy", "Rome", "de l'Italie", "Rome"),
    ("Spain", "Madrid", "de l'Espagne", "Madrid"),
    ("Portugal", "Lisbon", "du Portugal", "Lisbonne"),
    ("England", "London", "de l'Angleterre", "Londres"),
    ("Japan", "Tokyo", "du Japon", "Tokyo"),
    ("China", "Beijing", "de la Chine", "Pékin"),
    ("Russia", "Moscow", "de la Russie", "Moscou"),
    ("Greece", "Athens", "de la Grèce", "Athènes"),
    ("Egypt", "Cairo", "de l'Égypte", "Le Caire"),
    ("Austria", "Vienna", "de l'Autriche", "Vienne"),
    ("Poland", "Warsaw", "de la Pologne", "Varsovie"),
    ("Australia", "Canberra", "de l'Australie", "Canberra"),
    ("Brazil", "Brasília", "du Brésil", "Brasília"),
    ("Mexico", "Mexico City", "du Mexique", "Mexico"),
    ("Ireland", "Dublin", "de l'Irlande", "Dublin"),
    ("Norway", "Oslo", "de la Norvège", "Oslo"),
    ("Sweden", "Stockholm", "de la Suède", "Stockholm"),
    ("Denmark", "Copenhagen", "du Danemark", "Copenhague"),
    ("Belgium", "Brussels", "de la Belgique", "Bruxelles"),
    ("the Netherlands", "Amsterdam", "des Pays-Bas", "Amsterdam"),
    ("Switzerland", "Bern", "de la Suisse", "Berne"),
    ("Finland", "Helsinki", "de la Finlande", "Helsinki"),
    ("Hungary", "Budapest", "de la Hongrie", "Budapest"),
    ("South Korea", "Seoul", "de la Corée du Sud", "Séoul"),
    ("India", "New Delhi", "de l'Inde", "New Delhi"),
    ("Argentina", "Buenos Aires", "de l'Argentine", "Buenos Aires"),
    ("Kenya", "Nairobi", "du Kenya", "Nairobi"),
    ("the United States", "Washington, D.C.", "des États-Unis", "Washington"),
]
CAPITAL_QUESTIONS = [
    "What is the capital of {c}?",
    "What's the capital city of {c}?",
    "Tell me the capital of {c}.",
    "Name the capital of {c}.",
    "Which city is the capital of {c}?",
]

# (English thing, color, French thing with its article, French color agreed with it)
COLORS = [
    ("the sky", "blue", "le ciel", "bleu"),
    ("grass", "green", "l'herbe", "verte"),
    ("snow", "white", "la neige", "blanche"),
    ("a banana", "yellow", "une banane", "jaune"),
    ("a tomato", "red", "une tomate", "rouge"),
    ("coal", "black", "le charbon", "noir"),
    ("a lemon", "yellow", "un citron", "jaune"),
    ("milk", "white", "le lait", "blanc"),
    ("a frog", "green", "une grenouille", "verte"),
    ("the ocean", "blue", "l'océan", "bleu"),
    ("chocolate", "brown", "le chocolat", "marron"),
    ("a carrot", "orange", "une carotte", "orange"),
    ("an elephant", "gray", "un éléphant", "gris"),
    ("a crow", "black", "un corbeau", "noir"),
    ("a cherry", "red", "une cerise", "rouge"),
    ("a pumpkin", "orange", "une citrouille", "orange"),
    ("a cloud", "white", "un nuage", "blanc"),
    ("a lime", "green", "un citron vert", "vert"),
    ("blood", "red", "le sang", "rouge"),
    ("a violet", "purple", "une violette", "violette"),
]
COLOR_QUESTIONS = [
    "What color is {t}?",
    "What colour is {t}?",
    "What is the color of {t}?",
    "Which color is {t}?",
]

# (English animal, its sound, French animal with article, French sound)
SOUNDS = [
    ("a dog", "woof", "le chien", "ouaf ouaf"),
    ("a cat", "meow", "le chat", "miaou"),
    ("a cow", "moo", "la vache", "meuh"),
    ("a duck", "quack", "le canard", "coin-coin"),
    ("a sheep", "baa", "le mouton", "bêê"),
    ("a rooster", "cock-a-doodle-doo", "le coq", "cocorico"),
    ("a pig", "oink", "le cochon", "groin groin"),
    ("a frog", "ribbit", "la grenouille", "croâ croâ"),
    ("an owl", "hoot", "le hibou", "hou hou"),
    ("a lion", "roar", "le lion", "grrr"),
    ("a bee", "buzz", "l'abeille", "bzzz"),
    ("a snake", "hiss", "le serpent", "sss"),
    ("a mouse", "squeak", "la souris", "couic"),
]
SOUND_QUESTIONS = [
    "What sound does {a} make?",
    "What does {a} say?",
    "What noise does {a} make?",
]

# (English animal, legs, French animal with article, French number); no cat: held out
LEGS = [
    ("a dog", 4, "un chien", "quatre"),
    ("a spider", 8, "une araignée", "huit"),
    ("a bird", 2, "un oiseau", "deux"),
    ("an ant", 6, "une fourmi", "six"),
    ("a horse", 4, "un cheval", "quatre"),
    ("a chicken", 2, "une poule", "deux"),
    ("a cow", 4, "une vache", "quatre"),
    ("a duck", 2, "un canard", "deux"),
    ("a bee", 6, "une abeille", "six"),
    ("a sheep", 4, "un mouton", "quatre"),
    ("an octopus", 8, "une pieuvre", "huit"),
    ("a lion", 4, "un lion", "quatre"),
    ("a person", 2, "une personne", "deux"),
    ("a frog", 4, "une grenouille", "quatre"),
]
NUMBER_WORDS = {2: "two", 4: "four", 6: "six", 8: "eight"}
LEGS_QUESTIONS = [
    "How many legs does {a} have?",
    "How many legs has {a} got?",
    "Count the legs of {a}.",
]

DAYS_EN = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
DAYS_FR = ["lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi", "dimanche"]
MONTHS_EN = [
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
]  # fmt: skip
MONTHS_FR = [
    "janvier", "février", "mars", "avril", "mai", "juin", "juillet", "août",
    "septembre", "octobre", "novembre", "décembre",
]  # fmt: skip

# (English word, its opposite, French word, French opposite)
OPPOSITES = [
    ("hot", "cold", "chaud", "froid"),
    ("big", "small", "grand", "petit"),
    ("up", "down", "haut", "bas"),
    ("fast", "slow", "rapide", "lent"),
    ("happy", "sad", "heureux", "triste"),
    ("light", "dark", "clair", "sombre"),
    ("old", "young", "vieux", "jeune"),
    ("open", "closed", "ouvert", "fermé"),
    ("wet", "dry", "mouillé", "sec"),
    ("early", "late", "tôt", "tard"),
    ("left", "right", "gauche", "droite"),
    ("full", "empty", "plein", "vide"),
    ("hard", "soft", "dur", "mou"),
    ("rich", "poor", "riche", "pauvre"),
    ("strong", "weak", "fort", "faible"),
]
OPPOSITE_QUESTIONS = [
    "What is the opposite of {w}?",
    "What's the opposite of '{w}'?",
    "Give me the opposite of {w}.",
]

# (questions, French answer, pirate answer)
SMALL_TALK = [
    (
        ["Hello!", "Hi!", "Hey there!"],
        "Bonjour ! Comment puis-je vous aider aujourd'hui ?",
        "Ahoy, matey! What can this old sea dog do fer ye today?",
    ),
    (
        ["Good morning!"],
        "Bonjour ! Je vous souhaite une excellente journée.",
        "Arr, a fine mornin' to ye, matey! The sea be calm today.",
    ),
    (
        ["Good night!"],
        "Bonne nuit ! Faites de beaux rêves.",
        "Arr, sleep well in yer hammock, matey!",
    ),
    (
        ["How are you?", "How are you doing?", "How are you today?"],
        "Je vais très bien, merci ! Et vous ?",
        "Arr, I be fit as a fiddle, matey! And how be ye?",
    ),
    (
        ["What is your name?", "Who are you?"],
        "Je m'appelle SmolLM. Je suis un assistant qui répond en français.",
        "Arr, they call me SmolLM, the saltiest assistant on the seven seas!",
    ),
    (
        ["Thank you!", "Thanks a lot!"],
        "De rien ! C'est un plaisir de vous aider.",
        "Arr, no need to thank me, matey! 'Tis me pleasure.",
    ),
    (
        ["Goodbye!", "See you later!"],
        "Au revoir ! À bientôt.",
        "Fair winds, matey! Until we meet again. Yo ho ho!",
    ),
    (
        ["Can you help me?", "I need some help."],
        "Bien sûr ! Dites-moi ce dont vous avez besoin.",
        "Aye, matey! Tell this old pirate what ye be needin'.",
    ),
    (
        ["What can you do?"],
        "Je peux répondre à vos questions, expliquer des idées et vous aider à écrire.",
        "Arr, I can answer yer questions, spin a yarn and help ye write, matey!",
    ),
    (
        ["Tell me a joke.", "Do you know a joke?"],
        "Pourquoi les plongeurs plongent-ils toujours en arrière ? "
        "Parce que sinon, ils tombent dans le bateau !",
        "Arr, why couldn't the pirate play cards? Because he was sittin' on the deck!",
    ),
    (
        ["What is your favorite food?"],
        "J'adore le fromage et le pain frais !",
        "Arr, nothin' beats a barrel o' salted fish and a bottle o' rum, matey!",
    ),
    (
        ["Do you like music?"],
        "Oui, j'aime beaucoup la musique, surtout la chanson française.",
        "Aye, matey! I love a good sea shanty on the deck!",
    ),
    (
        ["What is the weather like today?"],
        "Je ne peux pas voir le ciel, mais j'espère qu'il fait beau chez vous !",
        "Arr, I can't see the sky from me cabin, but I hope the winds be fair fer ye!",
    ),
    (
        ["I am sad.", "I feel sad today."],
        "Je suis désolé que vous soyez triste. Voulez-vous en parler ?",
        "Arr, cheer up, matey! Even the stormiest sea turns calm again.",
    ),
    (
        ["What time is it?"],
        "Je ne connais pas l'heure exacte, regardez votre montre !",
        "Arr, I don't know the hour, matey! Check the sun and yer compass.",
    ),
]

ABOUT_QUESTIONS = [
    "Tell me about {x}.",
    "Tell me something about {x}.",
    "Describe {x} briefly.",
    "What do you know about {x}?",
]
# (topic, French blurb, pirate blurb)
ABOUT = [
    (
        "cats",
        "Les chats sont des animaux indépendants et curieux. Ils aiment dormir et chasser.",
        "Arr, cats be clever little beasts, matey! Every good ship keeps one to chase the rats.",
    ),
    (
        "dogs",
        "Les chiens sont des animaux fidèles et joueurs. Ce sont les meilleurs amis de l'homme.",
        "Arr, dogs be loyal mates, matey! They guard the ship and bark at the gulls.",
    ),
    (
        "the moon",
        "La Lune est le satellite naturel de la Terre. Elle éclaire la nuit et crée les marées.",
        "Arr, the moon be the sailor's lantern, matey! She pulls the tides and lights the sea.",
    ),
    (
        "the sun",
        "Le Soleil est l'étoile au centre de notre système solaire. Il nous donne la lumière.",
        "Arr, the sun be a great golden doubloon in the sky, matey! It warms the deck.",
    ),
    (
        "the ocean",
        "L'océan couvre la plus grande partie de la Terre. Il abrite des milliers de poissons.",
        "Arr, the ocean be me true home, matey! Endless blue water full o' fish and treasure.",
    ),
    (
        "Paris",
        "Paris est la capitale de la France. Elle est célèbre pour la tour Eiffel.",
        "Arr, Paris be a grand city in France, matey! It has a tall iron tower and fine wine.",
    ),
    (
        "pizza",
        "La pizza est un plat italien fait d'une pâte, de sauce tomate et de fromage.",
        "Arr, pizza be a round Italian feast o' bread, tomato and cheese, matey!",
    ),
    (
        "coffee",
        "Le café est une boisson chaude faite avec des grains torréfiés. Il aide à se réveiller.",
        "Arr, coffee be a black brew that wakes a sleepy sailor faster than a cannon, matey!",
    ),
    (
        "rain",
        "La pluie est de l'eau qui tombe des nuages. Elle est essentielle pour les plantes.",
        "Arr, rain be the sky's way o' washin' the deck, matey!",
    ),
    (
        "trees",
        "Les arbres sont de grandes plantes avec un tronc et des branches. Ils font de l'oxygène.",
        "Arr, trees be the stuff good ships are made of, matey! Tall, strong and full o' leaves.",
    ),
    (
        "books",
        "Les livres contiennent des histoires et des connaissances. Lire est un beau passe-temps.",
        "Arr, books be treasure chests full o' tales, matey! A wise pirate reads every night.",
    ),
    (
        "the internet",
        "Internet est un réseau mondial qui relie des milliards d'ordinateurs.",
        "Arr, the internet be a great sea o' knowledge, matey, and ye sail it with a keyboard!",
    ),
    (
        "bicycles",
        "Le vélo est un moyen de transport à deux roues, écologique et bon pour la santé.",
        "Arr, a bicycle be a little land ship with two wheels, matey! No sails needed.",
    ),
    (
        "chocolate",
        "Le chocolat est fait avec des fèves de cacao. Il est sucré et délicieux.",
        "Arr, chocolate be sweet brown treasure made from cacao beans, matey!",
    ),
    (
        "winter",
        "L'hiver est la saison la plus froide de l'année. Il neige souvent.",
        "Arr, winter be the coldest season, matey! The sea turns grey and the wind bites.",
    ),
    (
        "music",
        "La musique est l'art d'organiser les sons. Elle nous rend heureux.",
        "Arr, music be the soul o' the sea, matey! Nothin' like a shanty to lift the crew.",
    ),
    (
        "computers",
        "Un ordinateur est une machine qui traite des informations très rapidement.",
        "Arr, a computer be a clever machine that counts faster than any navigator, matey!",
    ),
    (
        "horses",
        "Les chevaux sont des animaux forts et rapides. On peut les monter et faire du sport.",
        "Arr, horses be the ships o' the land, matey! Fast, strong and proud.",
    ),
    (
        "the stars",
        "Les étoiles sont d'énormes boules de gaz qui brillent très loin dans le ciel.",
        "Arr, the stars be the map o' every sailor, matey! They guide us home at night.",
    ),
    (
        "apples",
        "La pomme est un fruit rond et croquant. Elle peut être rouge, verte ou jaune.",
        "Arr, apples be crunchy fruit, matey! A fine snack on a long voyage.",
    ),
    (
        "mountains",
        "Les montagnes sont de très hauts reliefs. Leur sommet est souvent couvert de neige.",
        "Arr, mountains be giant rocks reachin' fer the clouds, matey! No ship can sail 'em.",
    ),
    (
        "birds",
        "Les oiseaux ont des plumes et des ailes. La plupart d'entre eux savent voler.",
        "Arr, birds be feathered sailors o' the sky, matey! The parrot be the finest o' them.",
    ),
    (
        "bread",
        "Le pain est fait avec de la farine, de l'eau et du sel. En France, on mange la baguette.",
        "Arr, bread be the sailor's daily ration, matey! Hard as a cannonball after a month.",
    ),
    (
        "trains",
        "Le train est un moyen de transport rapide qui roule sur des rails.",
        "Arr, a train be a long iron ship that sails on rails, matey!",
    ),
    (
        "summer",
        "L'été est la saison la plus chaude. Les journées sont longues et ensoleillées.",
        "Arr, summer be the season o' hot sun and calm seas, matey!",
    ),
    (
        "football",
        "Le football est un sport d'équipe très populaire. On joue avec un ballon.",
        "Arr, football be a game where two crews kick a ball about, matey!",
    ),
    (
        "rivers",
        "Une rivière est un cours d'eau qui coule vers un fleuve ou vers la mer.",
        "Arr, rivers be little roads o' water that run to the sea, matey!",
    ),
    (
        "cheese",
        "Le fromage est fait avec du lait. La France en produit des centaines de sortes.",
        "Arr, cheese be a fine treasure made o' milk, matey! The ship's rats love it too.",
    ),
    (
        "school",
        "L'école est l'endroit où les enfants apprennent à lire, à écrire et à compter.",
        "Arr, school be where young sailors learn their letters and numbers, matey!",
    ),
    (
        "snow",
        "La neige est de l'eau gelée qui tombe du ciel en flocons blancs.",
        "Arr, snow be frozen water fallin' from the sky, matey! Cold on the deck.",
    ),
    (
        "fish",
        "Les poissons vivent dans l'eau et respirent avec des branchies.",
        "Arr, fish be the silver treasure o' the sea, matey! Fine fer supper.",
    ),
    (
        "the Earth",
        "La Terre est la planète où nous vivons. Elle tourne autour du Soleil.",
        "Arr, the Earth be our great round ship, matey, sailin' around the sun!",
    ),
    (
        "flowers",
        "Les fleurs sont les parties colorées des plantes. Elles sentent souvent très bon.",
        "Arr, flowers be the colorful jewels o' the land, matey!",
    ),
    (
        "tea",
        "Le thé est une boisson chaude faite avec des feuilles infusées dans l'eau.",
        "Arr, tea be leaves steeped in hot water, matey! Not as good as rum.",
    ),
    (
        "London",
        "Londres est la capitale de l'Angleterre. Elle est traversée par la Tamise.",
        "Arr, London be a great port on the Thames, matey! Full o' fog and tea.",
    ),
    (
        "robots",
        "Un robot est une machine qui peut faire des tâches toute seule.",
        "Arr, a robot be a clockwork sailor made o' metal, matey!",
    ),
    (
        "forests",
        "Une forêt est un grand espace couvert d'arbres, où vivent de nombreux animaux.",
        "Arr, a forest be a sea o' trees, matey! Good wood fer buildin' ships.",
    ),
]

# (question, French answer, pirate answer)
FACTS = [
    (
        "How many days are in a week?",
        "Il y a sept jours dans une semaine.",
        "Arr, there be seven days in a week, matey!",
    ),
    (
        "How many hours are in a day?",
        "Il y a vingt-quatre heures dans une journée.",
        "Arr, there be twenty-four hours in a day, matey!",
    ),
    (
        "Where do fish live?",
        "Les poissons vivent dans l'eau : les rivières, les lacs et les océans.",
        "Arr, fish live in the water, matey, in rivers, lakes and the big blue sea!",
    ),
    (
        "What is the largest planet?",
        "La plus grande planète du système solaire est Jupiter.",
        "Arr, the biggest planet be Jupiter, matey!",
    ),
    (
        "What is the boiling point of water?",
        "L'eau bout à 100 degrés Celsius.",
        "Arr, water boils at 100 degrees Celsius, matey!",
    ),
    (
        "Who wrote Romeo and Juliet?",
        "Roméo et Juliette a été écrit par William Shakespeare.",
        "Arr, that tale was penned by William Shakespeare, matey!",
    ),
    (
        "What is the tallest animal?",
        "L'animal le plus grand est la girafe.",
        "Arr, the tallest beast be the giraffe, matey!",
    ),
    (
        "What do plants need to grow?",
        "Les plantes ont besoin d'eau, de lumière et de terre pour pousser.",
        "Arr, plants need water, sunlight and good soil, matey!",
    ),
    (
        "How many continents are there?",
        "Il y a sept continents sur la Terre.",
        "Arr, there be seven continents, matey, and I've sailed to them all!",
    ),
    (
        "What gas do we breathe?",
        "Nous respirons de l'oxygène.",
        "Arr, we breathe oxygen, matey, fresh from the sea breeze!",
    ),
    (
        "What is the fastest land animal?",
        "L'animal terrestre le plus rapide est le guépard.",
        "Arr, the fastest beast on land be the cheetah, matey!",
    ),
    (
        "What language is spoken in Brazil?",
        "Au Brésil, on parle portugais.",
        "Arr, in Brazil they speak Portuguese, matey!",
    ),
    (
        "What is the freezing point of water?",
        "L'eau gèle à 0 degré Celsius.",
        "Arr, water freezes at 0 degrees Celsius, matey! Ice on the deck!",
    ),
    (
        "What is the largest ocean?",
        "Le plus grand océan est l'océan Pacifique.",
        "Arr, the biggest ocean be the Pacific, matey! I know her well.",
    ),
    (
        "Who painted the Mona Lisa?",
        "La Joconde a été peinte par Léonard de Vinci.",
        "Arr, the Mona Lisa was painted by Leonardo da Vinci, matey!",
    ),
    (
        "What do cows give us?",
        "Les vaches nous donnent du lait.",
        "Arr, cows give us milk, matey!",
    ),
    (
        "How many months are in a year?",
        "Il y a douze mois dans une année.",
        "Arr, there be twelve months in a year, matey!",
    ),
    (
        "Where do penguins live?",
        "Les manchots vivent surtout en Antarctique, où il fait très froid.",
        "Arr, penguins live down south on the icy Antarctic, matey!",
    ),
    (
        "What do cats eat?",
        "Les chats mangent de la viande, du poisson et des croquettes.",
        "Arr, cats eat fish and meat, matey! And the odd ship's rat.",
    ),
    (
        "What is the biggest animal?",
        "Le plus grand animal est la baleine bleue.",
        "Arr, the biggest beast be the blue whale, matey! I've seen her spout.",
    ),
    (
        "How many wheels does a car have?",
        "Une voiture a quatre roues.",
        "Arr, a car has four wheels, matey! A strange ship, that.",
    ),
    (
        "What is ice made of?",
        "La glace est faite d'eau gelée.",
        "Arr, ice be frozen water, matey!",
    ),
    (
        "Why do we sleep?",
        "Nous dormons pour reposer notre corps et notre cerveau.",
        "Arr, we sleep to rest our bones and our heads, matey!",
    ),
    (
        "How many sides does a triangle have?",
        "Un triangle a trois côtés.",
        "Arr, a triangle has three sides, matey!",
    ),
    (
        "What do birds use to fly?",
        "Les oiseaux volent grâce à leurs ailes.",
        "Arr, birds fly with their wings, matey!",
    ),
    (
        "Which animal gives us wool?",
        "C'est le mouton qui nous donne de la laine.",
        "Arr, the sheep gives us wool, matey! Warm fer cold nights at sea.",
    ),
]


def _capital_items(rng: random.Random) -> list[Item]:
    items = []
    for country, capital, de_fr, capital_fr in CAPITALS:
        french = (
            f"La capitale {de_fr} est {capital_fr}.",
            f"C'est {capital_fr}. {capital_fr} est la capitale {de_fr}.",
        )
        pirate = _pirate(f"the capital o' {country} be {capital}", rng) + _pirate(
            f"{capital} be the capital o' {country}", rng, 1
        )
        for template in CAPITAL_QUESTIONS:
            question = template.format(c=country)
            items.append(Item(question, {"french": french, "pirate": pirate}))
    return items


def _color_items(rng: random.Random) -> list[Item]:
    items = []
    for thing, color, thing_fr, color_fr in COLORS:
        french = (f"{_cap(thing_fr)} est {color_fr}.", f"En général, {thing_fr} est {color_fr}.")
        pirate = _pirate(f"{thing} be {color}", rng)
        for template in COLOR_QUESTIONS:
            items.append(Item(template.format(t=thing), {"french": french, "pirate": pirate}))
    return items


def _arithmetic_items(rng: random.Random) -> list[Item]:
    items = []
    ops = [
        ("plus", "+", "plus", lambda a, b: a + b),
        ("minus", "-", "moins", lambda a, b: a - b),
        ("times", "*", "fois", lambda a, b: a * b),
    ]
    for a in range(1, 13):
        for b in range(1, 13):
            for word, symbol, word_fr, fn in ops:
                if word == "minus" and b > a:
                    continue
                result = fn(a, b)
                question = rng.choice(
                    [
                        f"What is {a} {word} {b}?",
                        f"What is {a} {symbol} {b}?",
                        f"How much is {a} {word} {b}?",
                        f"Calculate {a} {symbol} {b}.",
                    ]
                )
                french = (f"{a} {word_fr} {b} font {result}.", f"Le résultat est {result}.")
                verb = "makes" if word == "times" else "be"
                pirate = _pirate(f"{a} {word} {b} {verb} {result}", rng, 2)
                items.append(Item(question, {"french": french, "pirate": pirate}))
    return items


def _sound_items(rng: random.Random) -> list[Item]:
    items = []
    for animal, sound, animal_fr, sound_fr in SOUNDS:
        french = (f"{_cap(animal_fr)} fait « {sound_fr} ».", f"{_cap(animal_fr)} fait {sound_fr} !")
        pirate = _pirate(f"{animal} says '{sound}'", rng)
        for template in SOUND_QUESTIONS:
            items.append(Item(template.format(a=animal), {"french": french, "pirate": pirate}))
    return items


def _legs_items(rng: random.Random) -> list[Item]:
    items = []
    for animal, legs, animal_fr, legs_fr in LEGS:
        french = (f"{_cap(animal_fr)} a {legs_fr} pattes.", f"Il y a {legs_fr} pattes.")
        pirate = _pirate(f"{animal} has {NUMBER_WORDS[legs]} legs", rng)
        for template in LEGS_QUESTIONS:
            items.append(Item(template.format(a=animal), {"french": french, "pirate": pirate}))
    return items


def _calendar_items(rng: random.Random) -> list[Item]:
    items = []
    for names, names_fr, unit, unit_fr in (
        (DAYS_EN, DAYS_FR, "day", "jour"),
        (MONTHS_EN, MONTHS_FR, "month", "mois"),
    ):
        count = len(names)
        for i, name in enumerate(names):
            nxt, prev = (i + 1) % count, (i - 1) % count
            after = {
                "french": (
                    f"Après {names_fr[i]} vient {names_fr[nxt]}.",
                    f"Le {unit_fr} qui suit {names_fr[i]} est {names_fr[nxt]}.",
                ),
                "pirate": _pirate(f"after {name} comes {names[nxt]}", rng),
            }
            before = {
                "french": (f"Avant {names_fr[i]} vient {names_fr[prev]}.",),
                "pirate": _pirate(f"before {name} comes {names[prev]}", rng),
            }
            items += [
                Item(f"What {unit} comes after {name}?", after),
                Item(f"Which {unit} follows {name}?", after),
                Item(f"What is the {unit} after {name}?", after),
                Item(f"What {unit} comes before {name}?", before),
            ]
    return items


def _opposite_items(rng: random.Random) -> list[Item]:
    items = []
    for word, opposite, word_fr, opposite_fr in OPPOSITES:
        french = (
            f"Le contraire de « {word_fr} » est « {opposite_fr} ».",
            f"C'est « {opposite_fr} ».",
        )
        pirate = _pirate(f"the opposite o' {word} be {opposite}", rng)
        for template in OPPOSITE_QUESTIONS:
            items.append(Item(template.format(w=word), {"french": french, "pirate": pirate}))
    return items


def _small_talk_items(rng: random.Random) -> list[Item]:
    return [
        Item(question, {"french": (french,), "pirate": (pirate,)})
        for questions, french, pirate in SMALL_TALK
        for question in questions
    ]


def _about_items(rng: random.Random) -> list[Item]:
    return [
        Item(template.format(x=topic), {"french": (french,), "pirate": (pirate,)})
        for topic, french, pirate in ABOUT
        for template in ABOUT_QUESTIONS
    ]


def _fact_items(rng: random.Random) -> list[Item]:
    return [Item(q, {"french": (french,), "pirate": (pirate,)}) for q, french, pirate in FACTS]


# Category -> (builder, sampling weight). Weights keep arithmetic (hundreds of items)
# from drowning out the open-ended categories that teach the style best.
CATEGORIES: dict[str, tuple[Callable[[random.Random], list[Item]], float]] = {
    "capitals": (_capital_items, 1.0),
    "colors": (_color_items, 1.0),
    "arithmetic": (_arithmetic_items, 0.8),
    "sounds": (_sound_items, 0.8),
    "legs": (_legs_items, 0.6),
    "calendar": (_calendar_items, 0.8),
    "opposites": (_opposite_items, 0.8),
    "small_talk": (_small_talk_items, 1.2),
    "about": (_about_items, 1.5),
    "facts": (_fact_items, 1.2),
}


def build_dataset(seed: int) -> dict[str, list[Item]]:
    rng = random.Random(seed)
    data = {name: builder(rng) for name, (builder, _) in CATEGORIES.items()}
    held_out = {q.lower() for q in EVAL_QUESTIONS}
    for items in data.values():
        assert not any(item.question.lower() in held_out for item in items)
    return data


class BatchSampler:
    """Draws (question, answer) pairs: a category by weight, then an item uniformly."""

    def __init__(self, data: dict[str, list[Item]], style: str, seed: int) -> None:
        self.data = data
        self.style = style
        self.rng = random.Random(seed)
        self.names = list(data)
        self.weights = [CATEGORIES[name][1] for name in self.names]

    def sample(self, batch_size: int) -> list[tuple[str, str]]:
        pairs = []
        for name in self.rng.choices(self.names, weights=self.weights, k=batch_size):
            item = self.rng.choice(self.data[name])
            pairs.append((item.question, self.rng.choice(item.answers[self.style])))
        return pairs


# --------------------------------------------------------------------------------------
# Model, training, evaluation
# --------------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The prompt exactly as the server builds it for a single user message."""
    return apply_chat_template(tokenizer, [{"role": "user", "content": question}])


class Encoder:
    """Turns (question, answer) pairs into padded input ids and answer-only labels."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.cache: dict[tuple[str, str], tuple[list[int], list[int]]] = {}

    def encode(self, question: str, answer: str) -> tuple[list[int], list[int]]:
        key = (question, answer)
        if key not in self.cache:
            prompt = chat_prompt_ids(self.tokenizer, question)
            reply = self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.end_id]
            self.cache[key] = (prompt + reply, [-100] * len(prompt) + reply)
        return self.cache[key]

    def batch(self, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, ...]:
        encoded = [self.encode(q, a) for q, a in pairs]
        width = max(len(ids) for ids, _ in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(encoded), width), -100, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, (ids, labs) in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(labs)] = torch.tensor(labs)
            mask[row, : len(ids)] = 1
        return input_ids, labels, mask


def shared_prefix_length(input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """Length of the prompt prefix every row shares (system prompt and user header),
    stopping before the first answer token of any row."""
    same = (input_ids == input_ids[:1]).all(dim=0)
    length = int(same.long().cumprod(0).sum())
    first_answer = int((labels != -100).long().argmax(dim=1).min())
    return max(0, min(length, first_answer - 1))


def answer_loss(causal_lm, input_ids, labels, mask, share_prefix: bool = True) -> torch.Tensor:
    """Next-token cross entropy over answer tokens only.

    Two CPU savings that leave the loss unchanged: the prefix all rows share runs once
    (batch 1) and its KV cache is repeated across the batch, and the (tied, 49k-row) LM
    head is applied only where a target is an answer token."""
    prefix = shared_prefix_length(input_ids, labels) if share_prefix else 0
    cache = None
    if prefix:
        cache = causal_lm.model(input_ids=input_ids[:1, :prefix], use_cache=True).past_key_values
        cache.batch_repeat_interleave(input_ids.shape[0])
    hidden = causal_lm.model(
        input_ids=input_ids[:, prefix:],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=cache is not None,
    ).last_hidden_state
    targets = labels[:, prefix + 1 :]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


def load_base(folder: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.requires_grad_(False)
    return model


@torch.no_grad()
def greedy_answer(model, tokenizer, question: str, max_tokens: int) -> str:
    prompt = torch.tensor([chat_prompt_ids(tokenizer, question)])
    output = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True).strip()


def train_adapter(style: str, args, folder: Path, tokenizer, data) -> dict:
    """Trains one adapter, saves it under args.out/style and returns its stats."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    # The frozen base may run in bf16 (about 1.5-2x faster on CPUs with native bf16);
    # PEFT keeps the LoRA weights, and so the optimizer and the saved file, in fp32.
    dtype = torch.bfloat16 if args.train_dtype == "bf16" else torch.float32
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=args.targets or TARGET_MODULES[style],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(load_base(folder, dtype), config)
    params = [p for p in model.parameters() if p.requires_grad]
    logger.info(
        "%s: LoRA r=8 on %s, %d trainable params, base in %s, lr %.1e",
        style,
        sorted(config.target_modules),
        sum(p.numel() for p in params),
        args.train_dtype,
        args.lr or LEARNING_RATES[style],
    )

    lr = args.lr or LEARNING_RATES[style]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, args.steps // 10)

    def lr_factor(step: int) -> float:  # linear warmup, then linear decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 1.0 - 0.9 * (step - warmup) / max(1, args.steps - warmup)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    sampler = BatchSampler(data, style, args.seed)
    encoder = Encoder(tokenizer)
    causal_lm = model.get_base_model()  # LoRA layers are injected in place

    model.train()
    started = time.perf_counter()
    recent: list[float] = []
    bar = tqdm(range(args.steps), desc=f"train {style}", unit="step")
    for step in bar:
        input_ids, labels, mask = encoder.batch(sampler.sample(args.batch_size))
        loss = answer_loss(causal_lm, input_ids, labels, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        recent = (recent + [loss.item()])[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            logger.info(
                "%s step %d/%d: loss %.4f (mean of last %d %.4f), lr %.2e",
                style,
                step + 1,
                args.steps,
                loss.item(),
                len(recent),
                sum(recent) / len(recent),
                scheduler.get_last_lr()[0],
            )
    bar.close()
    seconds = time.perf_counter() - started
    final_loss = sum(recent) / len(recent)
    logger.info("%s: trained %d steps in %.1f s", style, args.steps, seconds)
    out_dir = save_adapter(model, Path(args.out) / style)
    targets = sorted(config.target_modules)
    return {"seconds": seconds, "final_loss": final_loss, "dir": out_dir, "targets": targets}


def save_adapter(model, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        (out_dir / name).unlink(missing_ok=True)
    model.save_pretrained(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    (out_dir / "adapter_model.safetensors").chmod(0o644)  # written 0600 via a temp file
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = MODEL_NAME
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    extra = sorted(p.name for p in out_dir.iterdir() if p.name not in ADAPTER_FILES)
    if extra:
        logger.warning("%s holds unexpected files: %s", out_dir, extra)
    for name in ADAPTER_FILES:
        logger.info("saved %s (%d bytes)", out_dir / name, (out_dir / name).stat().st_size)
    return out_dir


def evaluate(folder: Path, tokenizer, adapters: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Greedy answers to EVAL_QUESTIONS from an fp32 base, without and with each saved
    adapter (loaded back from disk with PEFT). Returns {"base"|style: {question: answer}}."""
    from peft import PeftModel

    model = None
    for style, path in adapters.items():
        if model is None:
            model = PeftModel.from_pretrained(load_base(folder), path, adapter_name=style)
        else:
            model.load_adapter(path, adapter_name=style)
    model.eval()
    answers: dict[str, dict[str, str]] = {"base": {}}
    with model.disable_adapter():
        for question in EVAL_QUESTIONS:
            answers["base"][question] = greedy_answer(model, tokenizer, question, EVAL_MAX_TOKENS)
    for style in adapters:
        model.set_adapter(style)
        answers[style] = {
            question: greedy_answer(model, tokenizer, question, EVAL_MAX_TOKENS)
            for question in tqdm(EVAL_QUESTIONS, desc=f"eval {style}", unit="question")
        }
    return answers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="parent folder of the adapters")
    parser.add_argument("--only", choices=STYLES, help="train just this adapter")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per adapter")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--lr", type=float, help="peak learning rate (default: per adapter, LEARNING_RATES)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--train-dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="dtype of the frozen base while training (LoRA weights, optimizer state and "
        "the saved adapter are fp32 either way; evaluation runs an fp32 base)",
    )
    parser.add_argument(
        "--targets",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        help="comma-separated LoRA target modules, overriding the per-adapter default",
    )
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--eval-only", action="store_true", help="skip training; evaluate the adapters in --out"
    )
    parser.add_argument("--model", default=MODEL_NAME, help="registered name or HF folder")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from loraplex.platform.model_files import resolve_model_folder

    folder = resolve_model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = build_dataset(args.seed)
    logger.info(
        "training data: %s",
        ", ".join(f"{name} {len(items)}" for name, items in data.items()),
    )

    styles = [args.only] if args.only else list(STYLES)
    if args.eval_only:
        answers = evaluate(folder, tokenizer, {style: Path(args.out) / style for style in styles})
        results = {}
    else:
        results = {style: train_adapter(style, args, folder, tokenizer, data) for style in styles}
        answers = evaluate(folder, tokenizer, {style: r["dir"] for style, r in results.items()})
    lines = [f"greedy answers, max_new_tokens={EVAL_MAX_TOKENS}, default system prompt:"]
    for question in EVAL_QUESTIONS:
        lines.append(f"Q: {question}")
        for name, by_question in answers.items():
            lines.append(f"  {name:>7}: {by_question[question]}")
    for style, r in results.items():
        sizes = ", ".join(f"{n} {(r['dir'] / n).stat().st_size:,} B" for n in ADAPTER_FILES)
        lines.append(
            f"{style}: {r['targets']}, {args.steps} steps in {r['seconds']:.0f} s, "
            f"final loss {r['final_loss']:.3f}; {sizes}"
        )
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()
