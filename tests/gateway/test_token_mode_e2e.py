"""Token mode against what a real vLLM 0.32 did (tests/fixtures/vllm-0.32).

The fixtures were recorded from vLLM serving ``tests.support.vllm.tiny_model --seed 0``. Its tokenizer is
rebuilt here from the same recipe with the ``tokenizers`` library alone (corpus, trainer settings
and post-processor are the recipe's; no torch, no ``.build/``), saved as transformers 5 saves it,
and loaded through the gateway's own loader. The gateway's ids must then be vLLM's ids, and its
chain must cover exactly the blocks vLLM reported in its KV events -- the property a KV-event
index needs to translate ``BlockStored`` events into the gateway's keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from gateway.tokenizers import load_token_keyer
from scoring.prefix import chain_hashes_tokens, seed_for
from scoring.token_mode import TokenKeyer
from tests.support.vllm import tiny_model as tm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"
RECORDING: dict[str, Any] = json.loads((FIXTURES / "index.json").read_text())
INDEX: dict[str, Any] = RECORDING["files"]
BLOCK_SIZE = 32  # the server's --block-size (index.json server_args)
MODEL = tm.SERVED_MODEL_NAME


def rebuild_tokenizer(out: Path, *, template_in_config: bool = False) -> Path:
    """``tiny_model.train_tokenizer(seed=0)`` without transformers: same corpus, same trainer."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=tm.VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(tm.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tm.build_corpus(0), trainer=trainer)
    bos_id = tok.token_to_id(tm.BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tm.BOS} $A", pair=f"{tm.BOS} $A {tm.BOS} $B", special_tokens=[(tm.BOS, bos_id)]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # What transformers 5's save_pretrained wrote next to it for the recorded model.
    config: dict[str, Any] = {
        "backend": "tokenizers",
        "bos_token": tm.BOS,
        "eos_token": tm.EOS,
        "pad_token": tm.PAD,
        "extra_special_tokens": list(tm.ROLE_TOKENS),
        "model_max_length": tm.MODEL_SHAPE["max_position_embeddings"],
        "tokenizer_class": "TokenizersBackend",
    }
    if template_in_config:  # transformers 4 kept it here
        config["chat_template"] = tm.CHAT_TEMPLATE
    else:
        (out / "chat_template.jinja").write_text(tm.CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def keyer(tmp_path_factory: pytest.TempPathFactory) -> TokenKeyer:
    return load_token_keyer(rebuild_tokenizer(tmp_path_factory.mktemp("tiny-llama")))


def request(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(INDEX[name]["request"]["body"])
    return body


def block_stored() -> list[dict[str, Any]]:
    """The BlockStored events vLLM published (live channel), in order."""
    out: list[dict[str, Any]] = []
    for msg in json.loads((FIXTURES / "kv_events.decoded.json").read_text()):
        if msg["channel"] == "pub":
            out += [e for e in msg["payload"][1] if e["type"] == "BlockStored"]
    return out


def test_the_fixture_server_used_the_block_size_we_key_with() -> None:
    args: list[str] = RECORDING["server_args"]
    assert args[args.index("--block-size") + 1] == str(BLOCK_SIZE)
    assert args[args.index("--served-model-name") + 1] == MODEL
    assert {e["block_size"] for e in block_stored()} == {BLOCK_SIZE}


@pytest.mark.parametrize("template_in_config", [False, True])
def test_chat_ids_equal_vllm_tokenize(tmp_path: Path, template_in_config: bool) -> None:
    k = load_token_keyer(rebuild_tokenizer(tmp_path, template_in_config=template_in_config))
    body = request("tokenize_chat.json")
    want = json.loads((FIXTURES / "tokenize_chat.json").read_text())["tokens"]
    assert list(k.token_ids("chat", body)) == want
    assert k.key("chat", body, model=MODEL, block_size=BLOCK_SIZE).prompt_tokens == len(want)


def test_completion_ids_equal_vllm_tokenize(keyer: TokenKeyer) -> None:
    want = json.loads((FIXTURES / "tokenize.json").read_text())["tokens"]
    assert list(keyer.token_ids("completion", request("tokenize.json"))) == want
    # The same prompt sent as those ids (completion_stream_token_ids.sse) keys the same chain.
    as_ids = request("completion_stream_token_ids.sse")
    assert as_ids["prompt"] == want
    assert keyer.key("completion", as_ids, model=MODEL, block_size=2) == keyer.key(
        "completion", request("completion.json"), model=MODEL, block_size=2
    )


def test_chat_chain_covers_exactly_the_blocks_vllm_stored(keyer: TokenKeyer) -> None:
    body = request("prefix_first.sse")
    event = block_stored()[0]
    assert event["parent_block_hash"] is None  # the prompt's first block: a whole chain
    ids = list(keyer.token_ids("chat", body))
    assert len(ids) == 506  # usage.prompt_tokens of the recorded response
    stored = len(event["block_hashes"])
    assert ids[: stored * BLOCK_SIZE] == event["token_ids"]
    key = keyer.key("chat", body, model=MODEL, block_size=BLOCK_SIZE, max_blocks=256)
    assert len(key.chain) == stored == 506 // BLOCK_SIZE
    # A KV-event index can rebuild the request's chain from the event alone.
    assert key.chain == chain_hashes_tokens(
        event["token_ids"], block_size=BLOCK_SIZE, seed=seed_for(MODEL), max_blocks=256
    )


def test_cache_salt_separates_chains_as_vllm_separates_blocks(keyer: TokenKeyer) -> None:
    first, salted = request("prefix_first.sse"), request("prefix_second_salted.json")
    plain_event, salted_event = block_stored()[:2]
    # Same tokens, yet vLLM stored them as other blocks (the salt is in its first block's keys)...
    assert salted_event["token_ids"] == plain_event["token_ids"]
    assert salted_event["extra_keys"][0] == [salted["cache_salt"]]
    assert set(salted_event["block_hashes"]).isdisjoint(plain_event["block_hashes"])
    # ...and the gateway's chains share nothing either, so the index never claims a salted hit.
    a = keyer.key("chat", first, model=MODEL, block_size=BLOCK_SIZE)
    b = keyer.key("chat", salted, model=MODEL, block_size=BLOCK_SIZE)
    assert keyer.token_ids("chat", first) == keyer.token_ids("chat", salted)
    assert len(a.chain) == len(b.chain) == len(salted_event["block_hashes"])
    assert set(a.chain).isdisjoint(b.chain)
    # The repeat (prefix_second.sse, cached_tokens 480 on the worker) keys the same chain.
    assert keyer.key("chat", request("prefix_second.sse"), model=MODEL, block_size=BLOCK_SIZE) == a


def test_token_id_prompt_chain_covers_the_blocks_vllm_stored(keyer: TokenKeyer) -> None:
    body = request("max_tokens_clamped.json")  # a 1,000-id prompt
    event = block_stored()[4]
    assert body["prompt"][: len(event["token_ids"])] == event["token_ids"]
    key = keyer.key("completion", body, model=MODEL, block_size=BLOCK_SIZE, max_blocks=256)
    assert len(key.chain) == len(event["block_hashes"]) == 1000 // BLOCK_SIZE
    assert key.prompt_tokens == 1000
