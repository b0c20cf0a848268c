"""Request rules: one table, each rule written once with vLLM 0.32.0's message.

Every layer asks this table and renders its verdict in its own form: the raw client and
the text layer raise `InvalidRequestError` (a ``ValueError``) whose text is
``str(violation)``; the server answers HTTP 400 with ``param=violation.param`` and the
same text as ``message``. So one bad value gets one message at every entry point, and
that message is the one vLLM's frontend gives (``str()`` of its ``VLLMValidationError``:
the message, then `` (parameter=..., value=...)`` where vLLM names them).

The table is a set of *families*. A family is a group of `Rule` entries over one
*subject* (a ``SamplingParams``, a prompt, an ``EngineCoreRequest``...), checked in table
order; `Family.check` returns the first `Violation`, or ``None``. Rules that need the
engine's limits (``max_model_len``, vocabulary size, ``max_logprobs``...) read them from
a `Limits`, built once per client/model (not per request); an unknown limit (``None``)
skips the part of a rule that needs it.

Each rule says whether it protects a stock engine (``engine=True``: a value the engine
would die or wedge on, docs/protocol.md §3.7; most because the engine's decoder runs
vLLM's own ``SamplingParams`` checks in its input thread). The raw client checks those
only (``engine_only=True``); the text layer and the server check every rule.

The families, one module each:

============================  ==================================================  ========
family (module)               what                                                 who
============================  ==================================================  ========
`SAMPLING` (_sampling)        vLLM's ``SamplingParams._verify_args``, in order     all
`SAMPLING_LIMITS` (_model)    ``SamplingParams.verify`` against the model          all
`SAMPLING_WIRE` (_wire)       what the wire needs beyond that (types, duties)      all
`SAMPLING_RAW` (_wire)        one sequence per request                             raw
`STRUCTURED` (_structured)    a ``StructuredOutputsParams`` an engine can compile  all
`PROMPT` (_prompt)            empty, too long, no room for output, vocabulary      all
`PROMPT_TEXT` (_prompt)       a text prompt's length bound before tokenizing       text
`OPENAI` (_openai)            the OpenAI server's checks, both endpoints           server
`COMPLETION` (_openai)        ... of ``/v1/completions``                           server
`CHAT` (_openai)              ... of ``/v1/chat/completions``                      server
`REQUEST` (_request)          the ``EngineCoreRequest`` envelope                   raw
`POOLING` (_pooling)          a pooling request an engine can run                  all
`LORA` (_lora)                a LoRA adapter reference                             all
============================  ==================================================  ========

Adding a rule
-------------
Write a check ``(subject, limits) -> Fail | None`` in its family's module and register
it with the family's decorator, in the place vLLM checks it (order is the order of the
verdicts)::

    @SAMPLING.rule("top_p", param="top_p", example={"top_p": 2.0}, http={"top_p": 2})
    def _top_p(p: SamplingParams, limits: Limits) -> Fail | None:
        if type(p.top_p) is float and 0.0 < p.top_p <= 1.0:
            return None  # the common case first: this runs per request
        return f"top_p must be in (0, 1], got {p.top_p}.", p.top_p

A check returns ``None`` (fine) or a `Fail`: ``(message, value)`` with vLLM's message
and the value vLLM reports (``None`` for none), or ``(message, value, param)`` where
vLLM names another parameter than the rule's. ``field`` (first argument) is the field
the rule guards; ``param`` what vLLM names in its error (the HTTP 400's ``param``; leave
it ``None`` where vLLM's error names none, which also leaves `` (parameter=...)`` off
the text). A check may assume the rules before it in its family hold (``n`` is an int
once the ``n`` rule passed). ``engine=False`` marks a frontend-only rule. ``example`` is
a bad value for the tests (tests/protocol/test_rules.py): keywords for the family's
subject (`Family.example_subject`), written against `EXAMPLE_LIMITS` (``limits=`` changes
them for one rule); every rule has one and its example must break that very rule.
``http`` is the same bad value as fields of an OpenAI request body, for rules a server
request reaches; the walk test (tests/reliability/test_request_rules.py) then checks
the server's 400 too. ``family["name"]`` finds a rule by its check's name.

``fast`` (optional) is a Python expression over ``s`` (the subject) and ``limits`` that
is true only when the rule holds, e.g. ``fast="type(s.top_p) is float and 0.0 < s.top_p
<= 1.0"``: a family compiles its rules' expressions into one conjunction, so a valid
request costs one call per family; when it fails, every rule runs in order and gives
the verdict. tests/protocol/test_rules.py checks (Hypothesis) that an expression never
vouches for a value its rule refuses. The names it may use are `FAST_NAMES` and the
family's own (``Family(..., names=...)``).

Adding a family
---------------
A new module with ``NAME = Family("name", build_example)`` (``build_example(**example)``
makes a subject from a rule's example), its rules, an entry in `FAMILIES` and a line
in the table above; a layer that owns that kind of request calls
``NAME.check(subject, limits)`` (or ``NAME.raise_for``) where vLLM checks it and renders
the verdict: ``raise violation.error()`` (raw client, text layer) or
``HTTPError(str(violation), param=violation.param)`` (server).
"""

from __future__ import annotations

from typing import Any, Final

from ._core import (
    EXAMPLE_LIMITS,
    FAST_NAMES,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_N_SEQUENCES,
    NO_LIMITS,
    POOLING_TASKS,
    STRUCTURED_OUTPUT_BACKENDS,
    Fail,
    Family,
    Limits,
    PoolingModel,
    Rule,
    Violation,
)
from ._lora import LORA
from ._model import SAMPLING_LIMITS
from ._openai import CHAT, COMPLETION, OPENAI, OpenAIFields
from ._pooling import POOLING, with_pooling_defaults
from ._prompt import CONTEXT_SUFFIX, PROMPT, PROMPT_TEXT, PromptInput, PromptText
from ._request import REQUEST, request_prompt_length
from ._sampling import DEFAULTED_MAX_TOKENS, SAMPLING
from ._structured import STRUCTURED
from ._wire import SAMPLING_RAW, SAMPLING_WIRE

__all__ = [
    "CHAT",
    "COMPLETION",
    "CONTEXT_SUFFIX",
    "DEFAULTED_MAX_TOKENS",
    "EXAMPLE_LIMITS",
    "FAMILIES",
    "FAST_NAMES",
    "LORA",
    "MAX_LOGPROB_TOKEN_IDS",
    "MAX_N_SEQUENCES",
    "NO_LIMITS",
    "OPENAI",
    "POOLING",
    "POOLING_TASKS",
    "PROMPT",
    "PROMPT_TEXT",
    "REQUEST",
    "SAMPLING",
    "SAMPLING_LIMITS",
    "SAMPLING_RAW",
    "SAMPLING_WIRE",
    "STRUCTURED",
    "STRUCTURED_OUTPUT_BACKENDS",
    "Fail",
    "Family",
    "Limits",
    "OpenAIFields",
    "PoolingModel",
    "PromptInput",
    "PromptText",
    "Rule",
    "Violation",
    "request_prompt_length",
    "with_pooling_defaults",
]

FAMILIES: Final[tuple[Family[Any], ...]] = (
    SAMPLING,
    SAMPLING_LIMITS,
    SAMPLING_WIRE,
    SAMPLING_RAW,
    STRUCTURED,
    PROMPT,
    PROMPT_TEXT,
    OPENAI,
    COMPLETION,
    CHAT,
    REQUEST,
    POOLING,
    LORA,
)
"""Every family, for tests and documentation."""
