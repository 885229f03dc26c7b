"""The embedded default model "opt-tiny": a tiny random-weight OPT with its own tokenizer.

Built deterministically from a seed, so the service, the tests and the
notebooks work on a fresh machine with no downloads. `ensure_embedded_model()`
writes it once into `~/.cache/opt_serving/opt-tiny-np/` (or
`$OPT_SERVING_CACHE/opt-tiny-np/`) in the numpy-folder format, with a GPT-2
style vocab.json / merges.txt that transformers loads with the same class as
the real OPT tokenizer. `opt-serving tiny [--force]` prints the folder.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np

from opt_serving.config import OPT_CONFIGS, TINY_VOCAB_SIZE
from opt_serving.model.weights import param_shapes, save_numpy_folder
from opt_serving.settings import Settings

FOLDER_NAME = "opt-tiny-np"
MARKER = "opt_serving_embedded.json"
SEED = 0
# Bump when the way the model is built changes; the marker then no longer
# matches and the cached copy is rebuilt. Corpus edits are caught by its hash.
RECIPE_VERSION = 1

# fairseq order, as in the real OPT vocabulary
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
# The real OPT convention (see ../shared/opt-assets/README.md): </s> is also
# the BOS token and is prepended to every prompt.
TOKENIZER_CONFIG = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "</s>", "eos_token": "</s>",
                    "unk_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}

# Init scales. OPT's own 0.02 makes a random model echo its last token forever
# (the tied logits see mostly the input embedding); wider layers and
# embeddings give varied greedy output and a next-token entropy of about 4
# nats, so top-k / top-p / temperature visibly matter. Non-zero biases make a
# dropped bias show up in parity tests.
EMBED_STD = 0.2
LINEAR_STD = 0.3
BIAS_STD = 0.05


def default_cache_dir() -> Path:
    return Settings.from_env().cache_dir or Path.home() / ".cache" / "opt_serving"


def _recipe() -> dict:
    return {"recipe_version": RECIPE_VERSION, "seed": SEED,
            "corpus_sha256": hashlib.sha256(CORPUS.encode()).hexdigest(),
            "config": OPT_CONFIGS["tiny"].to_hf_dict(),
            "init": {"embed_std": EMBED_STD, "linear_std": LINEAR_STD, "bias_std": BIAS_STD}}


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_tokenizer(folder: Path) -> None:
    """Train a byte-level BPE on CORPUS (deterministic) and save it in GPT-2 form."""
    from tokenizers import ByteLevelBPETokenizer
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS.splitlines(), vocab_size=TINY_VOCAB_SIZE, min_frequency=2,
                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.save_model(str(folder))  # vocab.json + merges.txt
    _write_json(folder / "tokenizer_config.json", TOKENIZER_CONFIG)


def build_params(seed: int = SEED) -> dict[str, np.ndarray]:
    """Random float32 weights by metaseq key; the same seed gives the same bytes."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(OPT_CONFIGS["tiny"]).items():
        if "layer_norm" in name:
            value = np.ones(shape) if name.endswith(".weight") else np.zeros(shape)
        elif name.endswith(".bias"):
            value = rng.normal(0.0, BIAS_STD, shape)
        elif "embed_" in name:
            value = rng.normal(0.0, EMBED_STD, shape)
        else:
            value = rng.normal(0.0, LINEAR_STD, shape)
        params[name] = value.astype(np.float32)
    return params


def build_embedded_model(folder: str | os.PathLike) -> Path:
    """Write the whole model (weights, config.json, tokenizer, marker last) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_numpy_folder(folder, OPT_CONFIGS["tiny"], build_params())
    build_tokenizer(folder)
    _write_json(folder / MARKER, _recipe())
    return folder


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def ensure_embedded_model(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The folder of the embedded model, building it first if missing or stale.

    Built in a private temp folder and renamed into place, so a reader never
    sees a half-written model and two processes racing both end with a
    complete one (the loser of the rename throws its copy away).
    """
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = base / FOLDER_NAME
    want = _recipe()
    if not force and _read_marker(final) == want:
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=base))
    try:
        os.chmod(tmp, 0o755)
        build_embedded_model(tmp)
        for _ in range(5):
            try:
                os.rename(tmp, final)
                return final
            except OSError:  # something is already there
                if not force and _read_marker(final) == want:
                    return final  # another process finished first
                # a stale or broken copy (or the one --force replaces): move it aside, retry
                trash = base / f".{FOLDER_NAME}.old-{uuid.uuid4().hex}"
                try:
                    os.rename(final, trash)
                except FileNotFoundError:
                    continue
                _remove(trash)
                force = False  # the copy we replace now is ours
        raise RuntimeError(f"could not move the embedded model into {final}")
    finally:
        _remove(tmp)


# ---- `opt-serving tiny` ----

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached copy is current")
    parser.add_argument("--cache-dir", default=None,
                        help="cache folder (default: $OPT_SERVING_CACHE or ~/.cache/opt_serving)")


def run(args: argparse.Namespace) -> int:
    print(ensure_embedded_model(args.cache_dir, force=args.force))
    return 0


# ---- the tokenizer's training text (written for this project; public domain) ----

CORPUS = """\
The river ran slowly past the old mill, and in the evening the light on the water turned from silver to gold. Children came down to the bank after school to watch the boats, and the miller, who had lived in the valley all his life, told them stories about the winter when the river froze from one side to the other. He said that the ice was so thick that a horse and cart could cross it, and that the people of the village held a fair in the middle of the river, with music and bread and hot cider.
In the spring the snow melted on the hills and the water rose until it touched the first step of the mill. The farmers watched the sky and the fields, and when the ground was dry enough they began to plough. Every morning the same birds sang in the same trees, and every afternoon the wind came up from the south and carried the smell of the sea. It was a quiet place, but nobody who lived there thought it was dull, because there was always something to do and always someone to talk to.
The town library was a small stone building with a green door. Inside there were shelves of books on history, science, travel and the lives of famous men and women. The librarian kept a large book in which she wrote the name of every reader and the title of every book that was borrowed. She believed that a good book could change the way a person saw the world, and she was happy to spend an hour helping a young student find the right one.
A computer is a machine that follows a list of simple instructions very quickly. Each instruction may add two numbers, compare them, or move a value from one place in memory to another. By putting millions of these small steps together, a program can sort a list of names, draw a picture on a screen, or answer a question typed by a person far away. The language model is one such program: it reads a piece of text and guesses which word is most likely to come next, then adds that word to the text and guesses again.
To make good bread you need flour, water, salt and yeast, and above all you need time. Mix the flour and water and leave them to rest, then add the salt and the yeast and knead the dough until it is smooth. Let it rise in a warm room for two or three hours, shape it into a round loaf, and bake it in a hot oven until the crust is brown and the bottom sounds hollow when you tap it.
The ship left the harbour at dawn with a fair wind behind her. The captain stood on the deck and looked at the clouds in the west, which were thin and high, and he said that the weather would hold for at least three days. The sailors worked hard, pulling ropes and climbing the masts, and in the evening they sat together and sang songs about home. On the fifth day they saw land, a line of dark hills above a white beach, and everyone on board gave a great cheer.
Mathematics is the study of number, shape and pattern. A child learns to count on her fingers, then to add and subtract, and later to multiply and divide. In school she meets fractions and decimals, the area of a circle and the angles of a triangle. Some students find these ideas hard at first, but with patience they discover that each new idea is built on the ones that came before, like the floors of a tall house.
The weather this week will be cool and clear in the north, with light winds and a chance of frost at night. In the south there will be more cloud and some rain on Tuesday and Wednesday, but the weekend should be bright and warm. Farmers are reminded that the first of the month is the last day to register for the new water scheme, and that the market will open an hour earlier on Saturday.
Dear friend, thank you for your kind letter, which arrived yesterday and made me very glad. We are all well here, and the garden is full of flowers. My brother has found work in the city and writes to us every week. I hope that you will be able to visit us in the summer, when the days are long and we can walk by the lake in the evening. Please give my best wishes to your family.
Question: What is the capital city of France? Answer: Paris is the capital city of France. Question: How many days are there in a week? Answer: There are seven days in a week. Question: Why is the sky blue? Answer: Sunlight is scattered by the air, and blue light is scattered more than red light.
When the old clock in the hall struck twelve, the house was silent except for the rain on the windows. Anna lit a candle and went down the stairs, one step at a time, listening for any sound. She had heard a knock at the door, or thought she had, and she wanted to know who could be outside on such a night. When she opened the door there was no one there, only a small wooden box on the step with her name written on the lid in careful letters.
The market square was busy from early morning. Traders set up their stalls and called out the prices of apples, potatoes, cheese and fresh fish. An old woman sold honey in glass jars, and a young man played the violin beside the fountain while people dropped coins into his hat. By noon the square was crowded, and by evening it was empty again, with only a few leaves and paper bags blowing across the stones.
Good health depends on simple habits: eating fresh food, drinking clean water, sleeping well and walking every day. Doctors say that even a short walk after dinner can help the heart and clear the mind. It is also important to wash your hands before meals, to rest when you feel ill, and to visit a doctor if a fever lasts for more than a few days.
The train to the coast leaves from platform four at ten past nine. Passengers should have their tickets ready and keep their bags with them at all times. The journey takes about three hours and passes through farmland, forest and two small towns. Tea, coffee and sandwiches are served in the fourth carriage, and there is a quiet carriage at the front of the train for those who wish to read or sleep.
Long ago, before there were roads or maps, people found their way by the sun and the stars. Sailors learned which star stood still in the north while all the others turned around it, and travellers in the desert learned to read the shape of the dunes. These skills were passed from parents to children, and many of them are still useful today when a phone has no signal and the path is hard to see.
Science begins with a question. Why does a stone fall to the ground? Why does ice float on water? Why do some plants grow towards the light? A scientist makes a guess, called a hypothesis, and then designs an experiment to test it. If the results agree with the guess, she tests it again in a different way; if they do not, she changes the guess and tries again. In this way, slowly and carefully, we learn how the world works.
Our team met on Monday to plan the next version of the project. We agreed to fix the known bugs first, then to improve the speed of the server, and finally to write better documentation for new users. Each member chose one task and promised to report back by Friday. The meeting ended with a short discussion about testing, and everyone agreed that every change should come with a test that shows it works.
The cat sat on the windowsill in the afternoon sun, watching the birds in the garden with great interest. From time to time her tail moved, and once she stood up and pressed her nose to the glass, but the birds paid no attention to her. When the sun went behind a cloud she yawned, turned around twice, and went to sleep on the warm cushion by the fire.
In the beginning of the story a young king rules a small and peaceful country. One day a stranger arrives at the palace with a map of a land across the mountains, where, he says, there is a lake of clear water that never freezes and never runs dry. The king decides to find this lake, and he sets out with three friends, a horse, and enough food for a month. What they find on the other side of the mountains is not what any of them expected.
Please write your name and address clearly at the top of the form, and sign it at the bottom. If you are applying for more than one course, list them in order of preference. Forms must be returned by the end of the month. Late applications will be considered only if places are still available. For more information, contact the office between nine in the morning and five in the afternoon, Monday to Friday.
The museum opens at ten o'clock every day except Monday. On the ground floor there are stone tools, pots and jewellery found in the hills near the town, some of them more than four thousand years old. The first floor is given to paintings, mostly portraits and landscapes by local artists, and the top floor has a small room with old maps, clocks and instruments once used by sailors and surveyors. Entry is free for children and students.
It was the hottest summer anyone could remember. The grass turned yellow, the streams dried up, and the cows stood in the shade of the trees all afternoon. People kept their windows open at night and slept on the roofs of their houses. Then, at the end of August, a great storm came in from the sea. Thunder rolled over the valley, lightning struck the church tower, and the rain fell so hard that the streets became rivers.
Learning a new language is like learning to see a familiar room from a different corner. At first every word is a puzzle and every sentence is a small victory. Later the words begin to arrive on their own, and one day you notice that you have been thinking in the new language without trying. Teachers say that the best way to learn is to read a little every day, to listen to songs and stories, and not to be afraid of making mistakes.
The engineer checked the bridge every spring. She walked along it slowly, looking at the steel beams, the bolts and the concrete, and wrote down anything that seemed wrong: a crack, a patch of rust, a loose rail. Most years she found only small problems, which were fixed in a day or two, but once she found a deep crack in one of the main supports, and the bridge was closed for a month while it was repaired.
My grandmother kept chickens, two goats and a large vegetable garden behind her cottage. She grew beans, onions, carrots, cabbages and more potatoes than she could ever eat, and she gave the rest away to neighbours and friends. In the autumn she made jam from the plums and blackberries, and the whole kitchen smelled of fruit and sugar for a week.
Write a short story about a journey. Summarise the following paragraph in one sentence. Translate this sentence into French. List three reasons why exercise is good for you. Explain how a bicycle works to a ten year old child. Describe the view from your window on a winter morning.
The server receives a request, checks that it is well formed, and places it in a queue. A worker takes requests from the queue in small batches, runs the model on each batch, and sends the answers back as soon as they are ready. If too many requests arrive at once, the queue grows and each user waits a little longer, so the operators watch the length of the queue and add more workers when it stays long for too many minutes.
"""
