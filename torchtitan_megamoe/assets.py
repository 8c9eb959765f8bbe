"""Offline tokenizer + dataset for the tiny CPU training configs.

The torchtitan wheel ships neither the test tokenizer nor the ``c4_test`` data, and CI has no
network. This module makes both from generated text, deterministically:

- ``<out>/tokenizer/``: ``tokenizer.json`` (byte-level BPE trained with the ``tokenizers``
  library, ``TINY_VOCAB_SIZE`` entries, ``<|bos|>`` = 0, ``<|eos|>`` = 1) and
  ``tokenizer_config.json``; point ``[model] hf_assets_path`` at it.
- ``<out>/dataset/train.jsonl``: ``{"text": ...}`` lines; point ``[training] dataset_path`` at
  it with ``dataset = "c4_test"`` (TorchTitan loads that name with
  ``datasets.load_dataset(path, split="train")`` and reads the ``text`` field).

Usage: ``python -m torchtitan_megamoe.assets --out assets/megamoe_tiny``. Idempotent: a stamp
file records what was generated, and a second call with the same settings changes nothing.

Loading the dataset writes an Arrow cache under ``HF_HOME``; set ``HF_HOME`` to a scratch
directory and ``HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1`` so that nothing tries the network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import tempfile
from dataclasses import asdict, dataclass

BOS = "<|bos|>"
EOS = "<|eos|>"
STAMP = ".megamoe_assets.json"
FORMAT_VERSION = 1

# Kept equal to flavors.TINY_VOCAB_SIZE without importing TorchTitan here (this module must stay
# importable and fast in a bare environment); tests check that the two agree.
DEFAULT_VOCAB_SIZE = 512


@dataclass(frozen=True)
class AssetSpec:
    vocab_size: int = DEFAULT_VOCAB_SIZE
    """Tokenizer vocabulary, special tokens included; must not exceed the flavor's vocab_size."""

    num_docs: int = 3000
    """Number of generated documents (JSON lines)."""

    seed: int = 0
    """Seed of the text generator; same seed, same bytes."""

    def digest(self) -> str:
        payload = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tokenizer_dir(out: str) -> str:
    return os.path.join(out, "tokenizer")


def dataset_dir(out: str) -> str:
    return os.path.join(out, "dataset")


# --------------------------------------------------------------------------------------------
# Text: a small synthetic language with learnable structure (templates, agreement, counting),
# so that the loss visibly falls within a few steps.

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))


def _lexicon(rng: random.Random) -> dict[str, list[str]]:
    return {
        "noun": sorted({_word(rng, rng.randint(1, 2)) for _ in range(60)}),
        "verb": sorted({_word(rng, 2) + "s" for _ in range(40)}),
        "adj": sorted({_word(rng, rng.randint(1, 2)) + "y" for _ in range(30)}),
    }


def _sentence(rng: random.Random, lex: dict[str, list[str]]) -> str:
    kind = rng.random()
    if kind < 0.15:
        start = rng.randint(0, 90)
        return "count " + " ".join(str(start + i) for i in range(rng.randint(3, 8))) + "."
    subject = f"the {rng.choice(lex['adj'])} {rng.choice(lex['noun'])}"
    obj = f"the {rng.choice(lex['noun'])}"
    if kind < 0.6:
        return f"{subject} {rng.choice(lex['verb'])} {obj}."
    return f"{subject} {rng.choice(lex['verb'])} {obj} and {rng.choice(lex['verb'])} it again."


def generate_texts(spec: AssetSpec) -> list[str]:
    rng = random.Random(spec.seed)
    lex = _lexicon(rng)
    docs = []
    for _ in range(spec.num_docs):
        sentences = [_sentence(rng, lex) for _ in range(rng.randint(2, 6))]
        docs.append(" ".join(s.capitalize() for s in sentences))
    return docs


# --------------------------------------------------------------------------------------------
# Files.


def _atomic_write(path: str, data: str) -> None:
    # Two ranks or two tests may generate at once: write a temp file, then rename over.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import decoders, models, pre_tokenizers, trainers, Tokenizer

    tok = Tokenizer(models.BPE())
    # Byte-level: every string encodes (no unknown tokens), like the real Qwen/Llama tokenizers.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(
            f"trained tokenizer has {tok.get_vocab_size()} entries, more than vocab_size="
            f"{vocab_size}; raise vocab_size here and in the flavor together"
        )
    if tok.token_to_id(BOS) != 0 or tok.token_to_id(EOS) != 1:
        raise RuntimeError("special tokens must be ids 0 (bos) and 1 (eos); flavors rely on it")
    return tok


def is_current(out: str, spec: AssetSpec) -> bool:
    """True if ``out`` already holds the assets of ``spec`` (then nothing is regenerated)."""
    try:
        with open(os.path.join(out, STAMP)) as f:
            stamp = json.load(f)
    except (OSError, ValueError):
        return False
    needed = [
        os.path.join(tokenizer_dir(out), "tokenizer.json"),
        os.path.join(tokenizer_dir(out), "tokenizer_config.json"),
        os.path.join(dataset_dir(out), "train.jsonl"),
    ]
    return stamp.get("digest") == spec.digest() and all(os.path.isfile(p) for p in needed)


def make_assets(out: str, spec: AssetSpec = AssetSpec()) -> bool:
    """Write tokenizer + dataset into ``out``; return False if they were already current."""
    if spec.vocab_size < 300:
        raise ValueError(
            f"vocab_size={spec.vocab_size} is too small for a byte-level BPE (256 byte tokens + "
            f"2 specials + merges); use at least 300"
        )
    if spec.num_docs < 1:
        raise ValueError(f"num_docs must be >= 1, got {spec.num_docs}")
    if is_current(out, spec):
        return False
    texts = generate_texts(spec)
    tok = train_tokenizer(texts, spec.vocab_size)
    _atomic_write(os.path.join(tokenizer_dir(out), "tokenizer.json"), tok.to_str())
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        # TorchTitan's text dataset asks for bos/eos explicitly; plain encode() adds none.
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _atomic_write(
        os.path.join(tokenizer_dir(out), "tokenizer_config.json"), json.dumps(config, indent=2)
    )
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    _atomic_write(os.path.join(dataset_dir(out), "train.jsonl"), lines)
    stamp = {"digest": spec.digest(), "spec": asdict(spec), "vocab": tok.get_vocab_size()}
    _atomic_write(os.path.join(out, STAMP), json.dumps(stamp, indent=2))
    return True


def offline_env(hf_home: str) -> dict[str, str]:
    """Environment for loading the assets without network, with the HF cache in ``hf_home``."""
    return {
        "HF_HOME": hf_home,
        "HF_DATASETS_CACHE": os.path.join(hf_home, "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan_megamoe.assets",
        description="Generate the offline tokenizer + JSON-lines dataset of the tiny CPU configs.",
    )
    p.add_argument("--out", required=True, help="output directory (e.g. assets/megamoe_tiny)")
    p.add_argument("--vocab-size", type=int, default=AssetSpec.vocab_size)
    p.add_argument("--num-docs", type=int, default=AssetSpec.num_docs)
    p.add_argument("--seed", type=int, default=AssetSpec.seed)
    args = p.parse_args(argv)
    spec = AssetSpec(vocab_size=args.vocab_size, num_docs=args.num_docs, seed=args.seed)
    made = make_assets(args.out, spec)
    state = "wrote" if made else "up to date:"
    print(f"{state} {tokenizer_dir(args.out)} and {dataset_dir(args.out)}/train.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
