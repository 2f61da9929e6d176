"""Conversation-shaped prompts for a trace replay: shared system prompts, growing conversations.

Azure's conversation trace gives each request's arrival and token counts but no
conversation ids and no text, and a prefix cache only means something when prompts
share prefixes the way real chat traffic does. This module models that, seeded:

- **System prompts**: ``SYSTEM_PROMPTS`` (token counts): four of 1,100-2,000 tokens and
  two short ones (200, 300) so the trace's many ~400-token prompts can carry one too.
  Each is its own seeded sequence of distinct words, shared by every conversation that
  starts with it.
- **Conversations**: a request *continues* an earlier conversation with probability
  ``FOLLOW`` when one fits: its last turn was sent at least ``TURN_GAP_S`` earlier
  (schedule seconds: its reply has had time to come back) and within ``HORIZON_S``, and
  its next prompt (every earlier message, the previous reply, a new user turn of at least
  ``MIN_TURN`` tokens) fits the request's prompt size; the conversation is picked
  uniformly among those that fit. Otherwise it *starts* one: with probability
  ``SYSTEM_SHARE`` a system prompt (uniform among those that fit) and a first user turn.
- **Sizes come from the trace**: every request's prompt is exactly its trace
  ``prompt_tokens`` (chat framing counted as the gateway and the engine count it: 3 per
  message, its role, 3 for the reply; at least 8), so KV footprints and admission are the
  same as with the old one-word prompts; the model only decides how much of each prompt
  is shared. The new user turn is what the trace's size leaves after the shared part.
- **The previous reply** is the text the simulated engine generated for that request
  (``openai_fmt.generated_text``, its completion length), so a next turn repeats what the
  client got back.
- **Words**: the first ``VOCAB`` words of cl100k that are one token there and in o200k
  (letters only, with their leading space), drawn uniformly with a seeded RNG per system
  prompt and per user turn: two different texts share no prefix beyond chance (1 in
  4,096 per word), unlike one word repeated, where every prompt is a prefix of every
  longer one.

Pure apart from loading the tokenizer once for the word list.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.simbackend.openai_fmt import generated_text
from bench.trace import Request

SYSTEM_PROMPTS = (1100, 1400, 1700, 2000, 200, 300)  # content tokens of each system prompt
FOLLOW = 0.6  # a request continues a fitting conversation with this probability
SYSTEM_SHARE = 0.85  # a new conversation starts with a system prompt (one that fits)
MIN_TURN = 32  # content tokens of a new user turn, at least
TURN_GAP_S = 4.0  # schedule seconds between two turns of one conversation, at least
HORIZON_S = 60.0  # a conversation idle longer than this is over
VOCAB = 4096
MESSAGE = 4  # framing of one message: 3 + its role (one token: system, user, assistant)
REPLY = 3  # framing of the reply the prompt asks for
MIN_PROMPT = MESSAGE + 1 + REPLY  # one user message of one word


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Words (with their leading space) that are one token in cl100k and in o200k."""
    from extproc.tokens import encodings

    cl, o2 = encodings.get_encoding("cl100k_base"), encodings.get_encoding("o200k_base")
    out: list[str] = []
    for i in range(cl.n_vocab):
        try:
            b = cl.decode_single_token_bytes(i)
        except KeyError:
            continue
        if len(b) >= 4 and b[:1] == b" " and b.isascii() and b[1:].isalpha() and b[1:].islower():
            w = b.decode()
            if len(o2.encode_ordinary(w)) == 1:
                out.append(w)
                if len(out) == VOCAB:
                    break
    return tuple(out)


def words(key: str, n: int) -> str:
    """``n`` one-token words, a seeded function of ``key`` alone."""
    return "".join(random.Random(key).choices(vocabulary(), k=max(1, n)))


@dataclass(frozen=True)
class Part:
    role: str  # system | user | assistant
    key: str  # what seeds its words ("" for an assistant reply: the engine's text)
    tokens: int  # content tokens


@dataclass(frozen=True)
class Prompt:
    conversation: int
    turn: int  # 0: the conversation's first request
    system: int | None  # index into SYSTEM_PROMPTS
    parts: tuple[Part, ...]

    @property
    def tokens(self) -> int:
        return REPLY + sum(MESSAGE + p.tokens for p in self.parts)

    @property
    def shared_tokens(self) -> int:
        """Tokens before the last user turn (what an earlier request may have computed)."""
        return sum(MESSAGE + p.tokens for p in self.parts[:-1])


@dataclass
class _Conv:
    cid: int
    prompt: Prompt
    reply: int  # completion tokens of its last request
    last_at: float


class Conversations:
    """Prompts for ``requests`` (sorted by ``at``), one per request id."""

    def __init__(self, requests: Sequence[Request], seed: int = 17) -> None:
        self.seed = seed
        self.prompts: dict[int, Prompt] = {}
        rng = random.Random(seed)
        live: list[_Conv] = []
        count = 0
        for req in requests:
            size = max(req.prompt_tokens, MIN_PROMPT)
            live = [c for c in live if req.at - c.last_at <= HORIZON_S]
            fits = [c for c in live if req.at - c.last_at >= TURN_GAP_S
                    and c.prompt.tokens + MESSAGE + c.reply + MESSAGE + MIN_TURN <= size]
            if fits and rng.random() < FOLLOW:
                conv = fits[rng.randrange(len(fits))]
                head = (*conv.prompt.parts, Part("assistant", "", conv.reply))
                used = REPLY + sum(MESSAGE + p.tokens for p in head)
                prompt = Prompt(conv.cid, conv.prompt.turn + 1, conv.prompt.system,
                                (*head, Part("user", f"{seed}:user:{req.id}", size - used - MESSAGE)))
            else:
                system = self._system(rng, size)
                head = () if system is None else (Part("system", f"{seed}:system:{system}", SYSTEM_PROMPTS[system]),)
                used = REPLY + sum(MESSAGE + p.tokens for p in head)
                prompt = Prompt(count, 0, system, (*head, Part("user", f"{seed}:user:{req.id}", size - used - MESSAGE)))
                conv = _Conv(count, prompt, 0, req.at)
                live.append(conv)
                count += 1
            conv.prompt, conv.reply, conv.last_at = prompt, req.completion, req.at
            self.prompts[req.id] = prompt
        self.conversations = count

    @staticmethod
    def _system(rng: random.Random, size: int) -> int | None:
        """One of SYSTEM_PROMPTS drawn uniformly; the longest that fits if it does not."""
        if rng.random() >= SYSTEM_SHARE:
            return None
        k = rng.randrange(len(SYSTEM_PROMPTS))
        fits = [j for j, n in enumerate(SYSTEM_PROMPTS) if REPLY + MESSAGE + n + MESSAGE + MIN_TURN <= size]
        if k in fits or not fits:
            return k if fits else None
        return max(fits, key=lambda j: SYSTEM_PROMPTS[j])

    def messages(self, rid: int) -> list[dict[str, str]]:
        return [{"role": p.role, "content": generated_text(0, p.tokens) if p.role == "assistant"
                 else self._text(p.key, p.tokens)} for p in self.prompts[rid].parts]

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one instance per run; system prompts repeat
    def _text(self, key: str, n: int) -> str:
        return words(key, n)

    def body(self, req: Request, stream: bool = True) -> bytes:
        """The chat completion request body for ``req`` (as ``bench.loadgen.chat_body``)."""
        body: dict[str, object] = {"model": req.model, "messages": self.messages(req.id),
                                   "max_tokens": req.max_tokens, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body, separators=(",", ":")).encode()

    def summary(self) -> dict[str, float]:
        """Requests, conversations, share of follow-up turns and of prompt tokens shared."""
        ps = list(self.prompts.values())
        total = sum(p.tokens for p in ps) or 1
        return {"requests": len(ps), "conversations": self.conversations,
                "follow_ups": sum(p.turn > 0 for p in ps) / max(1, len(ps)),
                "with_system": sum(p.system is not None for p in ps) / max(1, len(ps)),
                "shared_tokens": sum(p.shared_tokens for p in ps) / total}
