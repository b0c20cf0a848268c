"""The rule table's machinery: `Limits`, `Rule`, `Violation`, `Family`, shared checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import numpy as np

from ..._exceptions import InvalidRequestError
from ..structs import RequestOutputKind

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator, Mapping

S = TypeVar("S")
Fail = tuple[str, object] | tuple[str, object, str]
"""A broken rule's (vLLM's message, the value vLLM reports or ``None``), and where
vLLM names a parameter other than the rule's, that parameter."""

#: vLLM's ``VLLM_MAX_N_SEQUENCES``.
MAX_N_SEQUENCES: Final = 16384
#: Pooling tasks a stock engine's decoder accepts.
POOLING_TASKS: Final = frozenset(
    {"embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"}
)
#: Structured-output backends an engine can instantiate from ``_backend``.
STRUCTURED_OUTPUT_BACKENDS: Final = frozenset(
    {"xgrammar", "guidance", "outlines", "lm-format-enforcer"}
)
MAX_LOGPROB_TOKEN_IDS: Final = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS
# A stock engine keeps token ids in int32 buffers; with no vocabulary size known, an id
# must at least fit there.
ENGINE_MAX_TOKEN_ID: Final = (1 << 31) - 1
INT64_MIN: Final = -(1 << 63)
UINT64_MAX: Final = (1 << 64) - 1
INT_ONLY: Final = {int}
OUTPUT_KINDS: Final = frozenset(int(k) for k in RequestOutputKind)
SAMPLING_EPS: Final = 1e-5


# ------------------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class PoolingModel:
    """What vLLM's ``PoolingParams.verify`` reads of the model: its served name, the
    embedding size (``hidden_size``), and whether it was trained for Matryoshka
    embeddings (``config.json``'s ``is_matryoshka`` / ``matryoshka_dimensions``)."""

    name: str
    embedding_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """What the rules may know about the model and engines (``None``: unknown).

    ``vocab_size`` bounds the ids a request names (stop ids, logit bias, allowed ids);
    ``max_token_id`` the ids of a prompt (vLLM: ``max(tokenizer.max_token_id,
    vocab_size - 1)``; defaults to ``vocab_size - 1``). ``max_logprobs`` ``-1`` means
    the vocabulary size. ``num_clients``: the engine's output addresses.
    """

    max_model_len: int | None = None
    vocab_size: int | None = None
    max_token_id: int | None = None
    max_logprobs: int | None = None
    supports_lora: bool | None = None
    supported_tasks: frozenset[str] | None = None
    num_clients: int | None = None
    structured_output_backend: str | None = None
    pooling_model: PoolingModel | None = None

    @property
    def prompt_id_bound(self) -> int:
        """The largest id a prompt may hold (the engine's int32 bound when unknown)."""
        if self.max_token_id is not None:
            return self.max_token_id
        if self.vocab_size is not None:
            return self.vocab_size - 1
        return ENGINE_MAX_TOKEN_ID


NO_LIMITS: Final = Limits()
EXAMPLE_LIMITS: Final = Limits(max_model_len=256, vocab_size=260, max_logprobs=20, num_clients=1)
"""The limits every rule's example is written for: the reference engine's ``echo``
model (a 260-token vocabulary) with a context of 256, vLLM's default ``max_logprobs``,
one client."""


@dataclass(frozen=True, slots=True, eq=False)
class Rule(Generic[S]):
    """One rule: ``check(subject, limits)`` is ``None`` or a `Fail`.

    ``name`` is ``"<family>.<check function>"``; ``field`` the field it guards;
    ``param`` the parameter vLLM names (``None``: vLLM names none); ``engine`` whether
    a stock engine could die or wedge on a value it refuses; ``example`` a bad value
    (keywords for the family's subject) and ``http`` the same as OpenAI body fields;
    ``example_limits`` the limits the example is written for; ``fast`` an expression
    over ``s`` (the subject) and ``limits``, true only when the rule holds (see
    `Family.check`).
    """

    name: str
    field: str
    check: Callable[[S, Limits], Fail | None]
    param: str | None
    engine: bool
    example: Mapping[str, object]
    http: Mapping[str, object] | None
    family: Family[S]
    example_limits: Limits
    fast: str | None

    def __call__(self, subject: S, limits: Limits = NO_LIMITS) -> Violation | None:
        """This rule alone: its `Violation` for ``subject``, or ``None``."""
        bad = self.check(subject, limits)
        return None if bad is None else Violation(self, *bad)


class Violation:
    """A verdict: the `Rule` broken, vLLM's ``message`` and reported ``value``.

    ``str(violation)`` is the text every layer shows (vLLM's ``str()`` of the error);
    ``param`` is the HTTP 400's ``param``, ``field`` the field the rule guards.
    """

    __slots__ = ("message", "param", "rule", "value")

    def __init__(
        self, rule: Rule[Any], message: str, value: object = None, param: str | None = None
    ) -> None:
        self.rule = rule
        self.message = message
        self.value = value
        self.param = rule.param if param is None else param

    @property
    def field(self) -> str:
        return self.rule.field

    def __str__(self) -> str:
        extras = []
        if self.param is not None:
            extras.append(f"parameter={self.param}")
        if self.value is not None:
            extras.append(f"value={self.value}")
        return f"{self.message} ({', '.join(extras)})" if extras else self.message

    def __repr__(self) -> str:
        return f"<Violation {self.rule.name}: {self}>"

    def error(self) -> InvalidRequestError:
        """This verdict as the exception the raw client and the text layer raise."""
        return InvalidRequestError(str(self), param=self.param, field=self.field)


class Family(Generic[S]):
    """A group of rules over one kind of subject, checked in order.

    ``build_example(**keywords)`` makes a subject from a rule's ``example`` (for tests
    and documentation).
    """

    def __init__(
        self,
        name: str,
        build_example: Callable[..., S],
        *,
        names: Mapping[str, object] | None = None,
    ) -> None:
        self.name = name
        self.build_example = build_example
        self.rules: tuple[Rule[S], ...] = ()
        self._names = {**FAST_NAMES, **(names or {})}
        self._fast: Callable[[S, Limits], bool] | None = None
        self._all: _Checks[S] = ()
        self._engine: _Checks[S] = ()
        self._slow: _Checks[S] = ()  # the rules without a fast expression
        self._slow_engine: _Checks[S] = ()

    def __repr__(self) -> str:
        return f"<Family {self.name}: {len(self.rules)} rules>"

    def __iter__(self) -> Iterator[Rule[S]]:
        return iter(self.rules)

    def __getitem__(self, name: str) -> Rule[S]:
        """The rule named ``"<family>.<name>"`` (``SAMPLING["max_tokens"]``)."""
        full = f"{self.name}.{name}"
        for rule in self.rules:
            if rule.name == full:
                return rule
        raise KeyError(full)

    def rule(
        self,
        field: str,
        *,
        param: str | None = None,
        engine: bool = True,
        example: Mapping[str, object],
        http: Mapping[str, object] | None = None,
        limits: Mapping[str, Any] | None = None,
        fast: str | None = None,
    ) -> Callable[[Callable[[S, Limits], Fail | None]], Rule[S]]:
        """Register the decorated check as this family's next rule (see the module);
        ``limits`` changes `EXAMPLE_LIMITS` for its example."""
        example_limits = (
            EXAMPLE_LIMITS if not limits else dataclasses.replace(EXAMPLE_LIMITS, **limits)
        )

        def register(check: Callable[[S, Limits], Fail | None]) -> Rule[S]:
            name = f"{self.name}.{check.__name__.strip('_')}"
            rule = Rule(
                name, field, check, param, engine, example, http, self, example_limits, fast
            )
            self.rules = (*self.rules, rule)
            self._all = (*self._all, (rule, check))
            if fast is None:
                self._slow = (*self._slow, (rule, check))
            if engine:
                self._engine = (*self._engine, (rule, check))
                if fast is None:
                    self._slow_engine = (*self._slow_engine, (rule, check))
            self._fast = None  # compiled again, with this rule, on the next check
            return rule

        return register

    def check(
        self, subject: S, limits: Limits = NO_LIMITS, *, engine_only: bool = False
    ) -> Violation | None:
        """The first rule ``subject`` breaks (only those that protect the engine with
        ``engine_only``), or ``None``.

        The common case costs one call: the rules' ``fast`` expressions, compiled into
        one conjunction, vouch for their rules; only the rules without one run. When
        the conjunction fails (or raises), every rule runs in order, so the verdict is
        the same either way.
        """
        fast = self._fast or self._compile()
        try:
            sure = fast(subject, limits)
        except Exception:  # a value the expressions did not expect: the rules decide
            sure = False
        if sure:
            checks = self._slow_engine if engine_only else self._slow
        else:
            checks = self._engine if engine_only else self._all
        for rule, check in checks:
            bad = check(subject, limits)
            if bad is not None:
                return Violation(rule, *bad)
        return None

    def fast_path(self, rule: Rule[S]) -> Callable[[S, Limits], bool] | None:
        """``rule``'s ``fast`` expression alone, compiled (``None`` without one); for
        tests that it vouches only for subjects the rule accepts."""
        if rule.fast is None:
            return None
        namespace = dict(self._names)
        source = f"def fast(s, limits):\n    return ({rule.fast})\n"
        exec(compile(source, f"<rule {rule.name} fast path>", "exec"), namespace)
        compiled: Callable[[S, Limits], bool] = namespace["fast"]  # type: ignore[assignment]
        return compiled

    def _compile(self) -> Callable[[S, Limits], bool]:
        exprs = [f"({rule.fast})" for rule in self.rules if rule.fast is not None]
        source = f"def fast(s, limits):\n    return {' and '.join(exprs) or 'True'}\n"
        namespace = dict(self._names)
        exec(compile(source, f"<rules {self.name} fast path>", "exec"), namespace)
        compiled: Callable[[S, Limits], bool] = namespace["fast"]  # type: ignore[assignment]
        self._fast = compiled
        return compiled

    def raise_for(
        self, subject: S, limits: Limits = NO_LIMITS, *, engine_only: bool = False
    ) -> None:
        """`check`, raising the verdict as `InvalidRequestError`."""
        violation = self.check(subject, limits, engine_only=engine_only)
        if violation is not None:
            raise violation.error()

    def example_subject(self, rule: Rule[S]) -> S:
        """The subject of ``rule``'s example."""
        return self.build_example(**rule.example)


_Checks = tuple[tuple["Rule[S]", "Callable[[S, Limits], Fail | None]"], ...]

# ----------------------------------------------------------------------------- helpers


def is_int(x: object) -> bool:
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))


def is_number(x: object) -> bool:
    t = type(x)
    if t is float or t is int:
        return True
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or isinstance(
        x, (np.floating, np.integer)
    )


def nonempty_str(x: object) -> bool:
    return isinstance(x, str) and bool(x)


def list_of(x: object, pred: Callable[[object], bool]) -> bool:
    return isinstance(x, list) and all(pred(item) for item in x)


def not_a(field: str, kind: str, value: object) -> Fail:
    return f"{field} must be {kind}, got {type(value).__name__}.", None


def wire_int(field: str, value: object, *, optional: bool = False) -> Fail | None:
    """An int msgpack can carry (a stock engine's decoder takes nothing else)."""
    if value is None and optional:
        return None
    if not is_int(value):
        return not_a(field, "an integer", value)
    assert isinstance(value, int)
    if not INT64_MIN <= value <= UINT64_MAX:
        return f"{field} must be between -2**63 and 2**64 - 1, got {value}.", None
    return None


def ids_within(ids: Collection[Any], top: int) -> bool:
    """Whether every id is an int in ``[0, top]``."""
    if len(ids) <= 8:  # a loop beats three C passes on the short lists (stop ids)
        for t in ids:  # noqa: SIM110 (a loop: no generator per call)
            if type(t) is not int or t < 0 or t > top:
                return False
        return True
    # C-speed passes on long lists (prompts); the culprit is found only on failure.
    return set(map(type, ids)) == INT_ONLY and min(ids) >= 0 and max(ids) <= top


def bad_token_ids(
    field: str, ids: object, bound: int | None, *, allow_empty: bool = True
) -> Fail | None:
    """``ids`` a list of ints in ``[0, bound]`` (``bound`` ``None``: the engine's)."""
    if not isinstance(ids, (list, tuple)):
        return not_a(field, "a list of token ids", ids)
    if not ids:
        return None if allow_empty else (f"{field} must not be empty.", None)
    top = ENGINE_MAX_TOKEN_ID if bound is None else bound
    if ids_within(ids, top):
        return None
    if set(map(type, ids)) != INT_ONLY:
        bad = next(t for t in ids if type(t) is not int)
        return f"{field} must contain only integers, got {bad!r}.", None
    if min(ids) < 0 or max(ids) > top:
        invalid = [t for t in ids if t < 0 or t > top]
        return f"token_id(s) {invalid} in {field} are out of vocabulary.", invalid
    return None


FAST_NAMES: Final[Mapping[str, object]] = {
    "ENGINE_MAX_TOKEN_ID": ENGINE_MAX_TOKEN_ID,
    "INT64_MIN": INT64_MIN,
    "UINT64_MAX": UINT64_MAX,
    "MAX_N_SEQUENCES": MAX_N_SEQUENCES,
    "SAMPLING_EPS": SAMPLING_EPS,
    "RequestOutputKind": RequestOutputKind,
    "ids_within": ids_within,
    "inf": math.inf,
}
"""The names a rule's ``fast`` expression may use (a family adds its own)."""
