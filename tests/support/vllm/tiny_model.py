"""Build a tiny, offline, deterministic Llama model that real vLLM can serve on a CPU.

Why: kvgate's integration suite needs a real vLLM server, but this machine has no GPU and no
access to a model hub. A random-init Llama with a locally trained byte-level BPE tokenizer is
enough: kvgate cares about wire formats, prefix caching, metrics and aborts, never about the
quality of the generated text. Everything is derived from ``--seed`` (corpus, tokenizer
training, weights), so the same seed gives the same token ids -- and therefore the same
prefix-cache blocks -- on every machine.

Run it with the vLLM venv's python (it has torch, transformers and tokenizers); when started
from another interpreter it re-executes itself in that venv::

    python -m tests.support.vllm.tiny_model --out .build/models/tiny-llama --seed 0

The directory holds ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and a stamp ``kvgate-tiny-model.json``;
an existing directory built with the same seed and recipe is reused untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO_ROOT / ".build" / "models" / "tiny-llama"
STAMP_NAME = "kvgate-tiny-model.json"
SERVED_MODEL_NAME = "tiny-llama"
# Bumped whenever the corpus, tokenizer or model recipe changes, so stale builds are redone.
RECIPE_VERSION = 2

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)

# A minimal `<|role|>` chat template. BOS comes from the template (vLLM then tokenizes the
# rendered chat without adding special tokens again), `<|end|>` closes each turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

VOCAB_SIZE = 2048
# Shape chosen to be as small as vLLM's CPU backend accepts: head_dim must be >= 32 (64 here),
# and GQA with one KV head keeps the per-token KV footprint at 2 layers * 2 * 64 values.
MODEL_SHAPE: dict[str, int] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}

# English-ish filler so typical test prompts ("Explain how a hash map works") tokenize into
# multi-byte tokens rather than single bytes; the rest of the corpus is seeded pseudo-words.
_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more when will "
    "would if so what about up out into than them some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three request token cache prefix block "
    "hash server worker gateway route latency stream model prompt user system assistant "
    "answer question explain tell story write code python function return value list map "
    "queue memory compute key value attention layer batch decode prefill schedule engine "
    "hello world please thanks summary document chapter section paragraph sentence word"
)
_WORDS = tuple(_WORDS_TEXT.split())
_SYLLABLES_TEXT = (
    "ka ri to na me su lo vi de pa ne shi mo ra te ku ya zo be fi gu ha je li mu no pe qu "
    "sa ti vu wa xe yo za an en in on un ar er ir or ur al el il ol ul"
)
_SYLLABLES = tuple(_SYLLABLES_TEXT.split())
_CODE_LINES = (
    "def {w}(x, y):\n    return x + y * {n}\n",
    "for i in range({n}):\n    print('{w}', i)\n",
    "if {w} is None:\n    raise ValueError('{w} missing')\n",
    '{{"id": {n}, "name": "{w}", "ok": true}}\n',
    "class {W}:\n    size = {n}\n",
    "# {w} {w2}: {n} items\n",
)


def build_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic training text for the BPE: words, pseudo-words, numbers, code and JSON.

    Generated rather than read from disk so that the vocabulary does not depend on which
    Python or documentation happens to be installed.
    """
    rng = random.Random(f"kvgate-tiny-corpus-{seed}")
    pseudo = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(1500)
    ]
    vocab = list(_WORDS) + pseudo

    def word() -> str:
        # Real words are favoured so common English and test-prompt words become single tokens.
        return rng.choice(_WORDS) if rng.random() < 0.5 else rng.choice(vocab)

    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 10
        if kind < 6:
            words = [word() for _ in range(rng.randint(6, 20))]
            if rng.random() < 0.3:
                words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]) + "\n")
        elif kind < 8:
            tpl = rng.choice(_CODE_LINES)
            w, w2 = word(), word()
            lines.append(tpl.format(w=w, w2=w2, W=w.capitalize(), n=rng.randint(0, 9999)))
        else:
            nums = " ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8))
            lines.append(nums + "\n")
    return lines


def train_tokenizer(seed: int, out_dir: Path) -> object:
    """Train a byte-level BPE on the seeded corpus and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Plain prompts (/v1/completions, /tokenize) get a BOS like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def save_model(seed: int, out_dir: Path, tokenizer: object, dtype: str) -> dict[str, object]:
    """Save a random-init LlamaForCausalLM whose vocabulary matches the tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = len(tokenizer)  # type: ignore[arg-type]
    bos_id = tokenizer.convert_tokens_to_ids(BOS)  # type: ignore[attr-defined]
    eos_id = tokenizer.convert_tokens_to_ids(EOS)  # type: ignore[attr-defined]
    pad_id = tokenizer.convert_tokens_to_ids(PAD)  # type: ignore[attr-defined]
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    config = LlamaConfig(
        vocab_size=vocab,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        **MODEL_SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    n_params = sum(p.numel() for p in model.parameters())
    return {"vocab_size": vocab, "params": n_params, "bos": bos_id, "eos": eos_id}


def _stamp_for(seed: int, dtype: str) -> dict[str, object]:
    return {"seed": seed, "dtype": dtype, "recipe": RECIPE_VERSION, "shape": MODEL_SHAPE}


def is_built(out_dir: Path, seed: int, dtype: str = "bfloat16") -> bool:
    """True when ``out_dir`` already holds this recipe's model for ``seed`` (cheap check)."""
    stamp = out_dir / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return all(data.get(k) == v for k, v in _stamp_for(seed, dtype).items())


def build_tiny_model(
    out_dir: Path, seed: int = 0, *, dtype: str = "bfloat16", force: bool = False
) -> Path:
    """Build the model in this interpreter (needs torch + transformers); returns ``out_dir``.

    Writes into a temporary sibling directory and renames it at the end, so an interrupted
    build never leaves a half-written model that a later run would mistake for a good one.
    """
    out_dir = out_dir.resolve()
    if not force and is_built(out_dir, seed, dtype):
        print(f"[tiny-model] reusing {out_dir} (seed {seed})", file=sys.stderr)
        return out_dir
    t0 = time.monotonic()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = train_tokenizer(seed, tmp)
    info = save_model(seed, tmp, tokenizer, dtype)
    elapsed = round(time.monotonic() - t0, 1)
    stamp = _stamp_for(seed, dtype) | info | {"served_model_name": SERVED_MODEL_NAME}
    stamp["build_seconds"] = elapsed
    (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    print(
        f"[tiny-model] built {out_dir} in {elapsed}s: vocab {info['vocab_size']}, "
        f"{info['params']} params, {dtype}, seed {seed}",
        file=sys.stderr,
    )
    return out_dir


def ensure_tiny_model(
    out_dir: Path = DEFAULT_OUT,
    seed: int = 0,
    *,
    python: str | os.PathLike[str] | None = None,
    dtype: str = "bfloat16",
    timeout: float = 600,
) -> Path:
    """Build the model from any interpreter by running this module in the vLLM venv.

    The integration suite runs in kvgate's own venv, which has no torch; this is its entry.
    """
    if is_built(out_dir, seed, dtype):
        return out_dir.resolve()
    if python is None:
        from tests.support.vllm.venv import ensure_venv

        python = ensure_venv()
    cmd = [str(python), "-m", "tests.support.vllm.tiny_model", "--out", str(out_dir)]
    cmd += ["--seed", str(seed), "--dtype", dtype]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0 or not is_built(out_dir, seed, dtype):
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"tiny model build failed (exit {proc.returncode}):\n{tail}")
    return out_dir.resolve()


def _reexec_in_venv(argv: list[str]) -> int:
    """Without torch/transformers here, run the same command with the vLLM venv's python."""
    from tests.support.vllm.venv import is_ready, venv_python

    if not is_ready():
        print(
            "[tiny-model] torch/transformers not importable and the vLLM venv is missing: "
            "run `python -m tests.support.vllm.venv` first",
            file=sys.stderr,
        )
        return 1
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [str(venv_python()), "-m", "tests.support.vllm.tiny_model", *argv]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="Build the tiny offline Llama for vLLM tests.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for corpus, BPE and weights")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    if not args.force and is_built(args.out, args.seed, args.dtype):
        print(f"[tiny-model] reusing {args.out.resolve()} (seed {args.seed})", file=sys.stderr)
        print(args.out.resolve())
        return 0
    try:
        import tokenizers  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return _reexec_in_venv(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = build_tiny_model(args.out, args.seed, dtype=args.dtype, force=args.force)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
