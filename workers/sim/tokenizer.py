"""A deterministic, model-free tokenizer and chat template for the simulated vLLM worker.

Why it exists: prefix caching works on token ids, so the simulator needs the same text to give the
same ids on every worker, every run and every machine, with no model download, and it must be fast
enough that a 40k-character prompt costs a few milliseconds. It is *not* trying to match any real
model's tokenizer; routing only needs it to be stable, reversible and roughly as dense as a BPE.

Vocabulary (ids are plain non-negative ints):

- ``0 .. 999``: a fixed list of common English words, each with a leading space (" the", " of",
  ...). The simulated engine samples generated tokens from this range, so output detokenizes to
  readable (if meaningless) English.
- ``1000 ..``: byte chunks. A chunk of ``n`` = 1..3 arbitrary bytes with big-endian value ``v`` has
  id ``1000 + OFFSET[n] + v`` (``OFFSET = {1: 0, 2: 2**8, 3: 2**8 + 2**16}``); a chunk of 4 ASCII
  bytes packs its four 7-bit values into ``v`` (28 bits) with ``OFFSET[4] = OFFSET[3] + 2**24``.
  Every id up to ``MAX_TOKEN_ID`` (about 2.85e8, so ids fit an int32 like real vocabularies) is
  therefore one exact byte string. Ids outside ``0 .. MAX_TOKEN_ID`` decode to U+FFFD instead of
  failing.

Encoding: the text is split GPT-2 style into pieces (an optional single leading space followed by a
run of letters, of digits or of other symbols; or a run of whitespace). A piece that is exactly a
vocabulary word is one token; any other piece is its bytes in chunks: 4 bytes at a time while it is
ASCII, else 3 (the tail takes 1-3 bytes). Concatenating
the pieces gives the text back, so ``decode(encode(t)) == t`` for every string. Decoding joins the
tokens' bytes and decodes UTF-8 with ``errors="replace"``, so arbitrary id sequences (e.g. a chunk
that splits a multi-byte character) still decode without error. English prose lands at roughly 3.5-4
characters per token.

Chat template (``render_chat``): ChatML-like, one block per message::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

When ``tools`` are given a leading ``system`` block lists them as compact JSON with sorted keys.
A message's ``content`` may be a string, ``None`` or a list of parts (text parts
``{"type": "text", "text": ...}`` are joined with newlines; other part types render as
``<{type}>``); assistant ``tool_calls`` render as compact JSON after the content. With
``add_generation_prompt`` (the default, as in vLLM) the prompt ends with
``<|im_start|>assistant\\n`` so the model "speaks" next.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import orjson

__all__ = [
    "BYTE_BASE",
    "MAX_TOKEN_ID",
    "VOCAB",
    "VOCAB_SIZE",
    "Tokenizer",
    "decode",
    "encode",
    "render_chat",
    "token_str",
]

# Order matters: a word's position is its token id (duplicates below are dropped, first wins).
_WORDS_TEXT = """
the of and to in is that it was for on are as with his they at be this from have or by one had not
but what all were when we there can an your which their said if do will each about how up out them
then she many some so these would other into has more her two like him see time could no make than
first been its who now people my made over did down only way find use may water long little very
after words called just where most know get through back much before go good new write our used me
man too any day same right look think also around another came come work three word must because
does part even place well such here take why things help put years different away again off went
old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough took
sometimes four head above kind began almost live page got earth need far hand high year mother
light parts country father let night following picture being study second eyes soon times story
boys since white days paper hard near sentence better best across during today others however sure
means knew try told young miles sun ways thing whole hear example heard several change answer room
sea against top turned learn point city play toward five using himself usually money seen car
morning given trees hundred open family south north east west front question above body music color
stand questions fish area mark dog horse birds problem complete rather ever short lost either
quickly order half fire red door become list letter hands less friends stop table among plants sure
run grow cold notice voice gave green power town fine certain fly unit lead cry dark machine note
wait plan figure star box noun field rest correct able pound done beauty drive stood contain teach
week final main map rain rule govern pull pattern slow center love person pay serve appear road
travel wood street behind hot check game shape equate miss brought heat snow tire bring yes distant
fill east paint language among ready above measure ago system record boat common gold possible
plane stead dry wonder laugh thousand ran round act class wind early reach force blue object decide
surface deep moon island foot busy test boat true during problem piece told knew pass since top
whole king space heard best hour remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple vowel war lay pattern numeral mind cause lake rock
moment scale loud spring observe child straight consonant nation dictionary milk speed method organ
pay age section dress cloud surprise quiet stone tiny climb cool design poor lot experiment bottom
key iron single stick flat twenty skin smile crease hole trade melody trip office receive row mouth
exact symbol die least trouble shout except wrote seed tone join suggest clean break lady yard rise
bad blow oil blood touch grew cent mix team wire cost flow fair bank collect save control decimal
gentle woman captain practice separate difficult doctor please protect noon whose locate ring
character insect caught period indicate radio spoke atom human history effect electric expect crop
modern element hit student corner party supply bone rail imagine provide agree thus capital chair
danger fruit rich thick soldier process operate guess necessary sharp wing create neighbor wash bat
crowd corn compare poem string bell depend meat rub tube famous dollar stream fear sight thin
triangle planet hurry chief colony clock mine tie enter major fresh search send yellow gun allow
print dead spot desert suit current lift rose continue block chart hat sell success company
subtract event particular deal swim term opposite wife shoe shoulder spread arrange camp invent
cotton born determine quart nine truck noise level chance gather shop stretch throw shine property
column molecule select wrong gray repeat require broad prepare salt nose plural anger claim
continent oxygen sugar death pretty skill women season solution magnet silver thank branch match
suffix especially fig afraid huge sister steel discuss forward similar guide experience score apple
bought led pitch coat mass card band rope slip win dream evening condition feed tool total basic
smell valley nor double seat arrive master track parent shore division sheet substance favor
connect post spend chord fat glad original share station dad bread charge proper bar offer segment
slave duck instant market degree populate chick dear enemy reply drink occur support speech nature
range steam motion path liquid log meant quotient teeth shell neck data model server request token
cache memory network value function result state client error update report service support market
policy health research public group program money business issue member level office national
federal security member access quality price energy policy total rate value design process growth
range effort project feature user account online content software product include provide create
support process offer model within among around local major available general social global private
simple special various recent similar early human natural physical financial economic political
medical personal legal current future recent final main able about above accept across act action
add address admit adult affect after again age agency agent ago air allow almost alone already
although always american amount analysis animal answer anyone anything appear apply approach argue
arm army art article artist assume attack attention author authority avoid baby bag ball base beat
beautiful bed behavior believe benefit beyond bill billion bit black board book born both box
brother budget build building buy call camera campaign cancer candidate career carry case catch
cell central century certainly chair challenge check choice choose church citizen civil clear
clearly close coach collection college commercial community compare computer concern conference
congress consider consumer contain continue conversation couple course court cover crime culture
cup cut daughter dead debate decade decision defense democratic describe despite detail develop
development difference dinner direction director discover discussion disease doctor draw drop
economy edge education election else employee encourage environment especially establish evidence
exactly executive exist expert explain face fact factor fail fall far fast fight figure film
financial finger finish firm floor focus follow force foreign forget former forward free friend
full fund garden gas generation girl glass goal grow guy hair hang happen happy hear heart help
herself hospital hotel however huge husband idea identify image impact improve include increase
indeed indicate individual industry information inside instead institution international interview
investment involve item itself job join judge just kitchen knowledge language large law lawyer lay
leader learn leave legal less let letter lie likely listen little loss low management manager
material matter maybe mean media meeting memory mention message middle military million minute
mission modern moment month movie mrs much myself near nearly necessary network news newspaper nice
none note nothing notice occur officer official oil ok once operation opportunity option
organization outside owner pain painting paper participant partner pass past patient peace perform
perhaps phone physical pick picture pressure prevent probably produce professional professor
pressure quickly quite radio raise reality realize reason receive recently recognize reduce reflect
region relate relationship religious remain remove represent republican require resource respond
response responsibility return reveal risk role rule safe scene science scientist season seek sense
series serious several sex share shoot shot significant simply sister site situation size skill
society soldier somebody someone son source southern speak specific sport staff stage standard
statement stock store strategy strong structure style subject successful suddenly suffer suggest
summer sure table task tax teacher technology television tend theory therefore third threat
throughout thus tonight total tough traditional training treat treatment trial truth type
understand unit upon usually victim view violence visit vote wall watch weapon wear weight whatever
whether whom wide win window wish within wonder worker worry writer wrong yeah yet yourself
"""
_WORDS: list[str] = _WORDS_TEXT.split()


def _build_vocab(words: Iterable[str]) -> tuple[str, ...]:
    """First 1000 distinct words, in list order: the order is the id assignment, so never sort."""
    uniq = list(dict.fromkeys(words))
    if len(uniq) < 1000:
        raise RuntimeError("the simulator vocabulary needs 1000 distinct words")
    return tuple(" " + w for w in uniq[:1000])


VOCAB: tuple[str, ...] = _build_vocab(_WORDS)
VOCAB_SIZE = len(VOCAB)
assert VOCAB_SIZE == 1000

BYTE_BASE = 1000
_OFF1 = 0
_OFF2 = 1 << 8
_OFF3 = _OFF2 + (1 << 16)
_OFF4 = _OFF3 + (1 << 24)
MAX_TOKEN_ID = BYTE_BASE + _OFF4 + (1 << 28) - 1

_WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
_WORD_BYTES: tuple[bytes, ...] = tuple(w.encode() for w in VOCAB)
_PIECE_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
_REPLACEMENT = "\ufffd".encode()


def _bytes_to_ids(data: bytes) -> list[int]:
    """Pack bytes into chunk ids; the length-dependent offsets keep the mapping reversible."""
    out: list[int] = []
    n = len(data)
    if data.isascii():
        full = n - n % 4
        base4 = BYTE_BASE + _OFF4
        for i in range(0, full, 4):
            a, b, c, d = data[i : i + 4]
            out.append(base4 + ((a << 21) | (b << 14) | (c << 7) | d))
    else:
        full = n - n % 3
        base3 = BYTE_BASE + _OFF3
        for i in range(0, full, 3):
            out.append(base3 + int.from_bytes(data[i : i + 3], "big"))
    rest = data[full:]
    while rest:
        take = min(3, len(rest))
        chunk, rest = rest[:take], rest[take:]
        off = _OFF3 if take == 3 else _OFF2 if take == 2 else _OFF1
        out.append(BYTE_BASE + off + int.from_bytes(chunk, "big"))
    return out


@lru_cache(maxsize=65536)
def _piece_ids(piece: str) -> tuple[int, ...]:
    """Cached per piece: natural text repeats pieces heavily, which makes long prompts cheap."""
    wid = _WORD_TO_ID.get(piece)
    if wid is not None:
        return (wid,)
    return tuple(_bytes_to_ids(piece.encode("utf-8", "surrogatepass")))


def token_bytes(token_id: int) -> bytes:
    """The exact bytes one id stands for (U+FFFD's bytes for ids outside the vocabulary)."""
    if 0 <= token_id < BYTE_BASE:
        return _WORD_BYTES[token_id]
    v = token_id - BYTE_BASE
    if v < 0 or token_id > MAX_TOKEN_ID:
        return _REPLACEMENT
    if v < _OFF2:
        return bytes((v,))
    if v < _OFF3:
        return (v - _OFF2).to_bytes(2, "big")
    if v < _OFF4:
        return (v - _OFF3).to_bytes(3, "big")
    v -= _OFF4
    return bytes(((v >> 21) & 0x7F, (v >> 14) & 0x7F, (v >> 7) & 0x7F, v & 0x7F))


def encode(text: str) -> list[int]:
    """Text to token ids; the same text always yields the same ids."""
    out: list[int] = []
    extend = out.extend
    for piece in _PIECE_RE.findall(text):
        extend(_piece_ids(piece))
    return out


def decode_bytes(token_ids: Iterable[int]) -> bytes:
    """Raw bytes of a token sequence; used by streaming to decode UTF-8 incrementally."""
    wb = _WORD_BYTES
    return b"".join(wb[t] if 0 <= t < BYTE_BASE else token_bytes(t) for t in token_ids)


def decode(token_ids: Iterable[int]) -> str:
    """Token ids to text; never fails (invalid UTF-8 becomes U+FFFD, as in HF tokenizers)."""
    return decode_bytes(token_ids).decode("utf-8", "replace")


def token_str(token_id: int) -> str:
    """One token on its own, as `/tokenize` reports it in `token_strs`."""
    return token_bytes(token_id).decode("utf-8", "replace")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                ptype = part.get("type", "text")
                if ptype == "text":
                    parts.append(str(part.get("text", "")))
                else:
                    parts.append(f"<{ptype}>")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return str(content)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render OpenAI chat messages into one prompt string (see the module docstring).

    Raises ValueError for a message that is not an object with a string role, which the server
    reports as a 400 like vLLM does for malformed messages.
    """
    out: list[str] = []
    if tools:
        tools_json = orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS).decode()
        out.append(f"<|im_start|>system\n# Tools\n{tools_json}<|im_end|>\n")
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise ValueError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError("each message must have a string 'role'")
        text = _content_text(msg.get("content"))
        tool_calls = msg.get("tool_calls")
        if tool_calls:
            text += orjson.dumps(tool_calls, option=orjson.OPT_SORT_KEYS).decode()
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class Tokenizer:
    """Object facade so callers can hold "a tokenizer" like they would an HF one."""

    vocab_size = MAX_TOKEN_ID + 1

    encode = staticmethod(encode)
    decode = staticmethod(decode)
    decode_bytes = staticmethod(decode_bytes)
    token_str = staticmethod(token_str)
    render_chat = staticmethod(render_chat)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        return encode(render_chat(messages, tools, add_generation_prompt))
