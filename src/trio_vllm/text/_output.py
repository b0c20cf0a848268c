"""Engine outputs to request outputs, as vLLM 0.32.0's ``OutputProcessor`` and ``ParentRequest``.

Feed `OutputProcessor.process_outputs` the ``EngineCoreOutput`` s of the requests you
added; it returns the `RequestOutput` s to hand to their callers and
the internal ids of requests the engine must ABORT (a stop string matched: the engine does
not know stop strings, so it would keep generating). Sending that ABORT is the caller's
job; this module does no I/O.

``n > 1`` is vLLM's parallel sampling: a `ParentRequest` makes ``n`` child requests
``"{index}_{parent_id}"`` (with ``seed + index`` when a seed is set); the children's outputs
are gathered under the parent's external id. FINAL_ONLY waits for every child and returns
all ``n`` completions at once, in index order.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..protocol import FinishReason, RequestOutputKind
from ._detokenizer import IncrementalDetokenizer
from ._logprobs import LogprobsProcessor
from ._types import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..protocol import EngineCoreOutput, EngineCoreRequest, SamplingParams
    from ._tokenizer import Tokenizer

__all__ = ["OutputProcessor", "OutputProcessorOutput", "ParentRequest", "RequestState"]


class ParentRequest:
    """An ``n > 1`` request: makes the child requests' ids and params, gathers outputs.

    ``request_id`` is the internal parent id (never sent to the engine), ``external_req_id``
    the caller's. ``child_requests`` holds the children not finished yet.
    """

    def __init__(self, request_id: str, external_req_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.external_req_id = external_req_id
        self.sampling_params = params
        self.child_requests: set[str] = set()
        self.output_aggregator: list[CompletionOutput | None] = (
            [None] * params.n if params.output_kind == RequestOutputKind.FINAL_ONLY else []
        )
        self._cached_child_params: SamplingParams | None = None

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The ``index``-th child's request id and sampling params (``n=1``, and
        ``seed + index`` when the parent has a seed)."""
        child_req_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_req_id)
        return child_req_id, self._child_params(index)

    def _child_params(self, index: int) -> SamplingParams:
        if self._cached_child_params is not None:
            return self._cached_child_params
        child = copy.copy(self.sampling_params)
        child.n = 1
        # Copied containers: the child's frontend duties must not touch the parent's.
        child._all_stop_token_ids = set(child._all_stop_token_ids)
        child.stop_token_ids = list(child.stop_token_ids or ())
        seed = self.sampling_params.seed
        if seed is None:
            self._cached_child_params = child
        else:
            child.seed = seed + index
        return child

    def get_outputs(
        self, child_request_id: str, completion: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """What the parent's caller sees of one child's output, and whether all are done."""
        already_finished_and_returned = False
        if completion.finished():
            if child_request_id in self.child_requests:
                self.child_requests.remove(child_request_id)
            else:
                already_finished_and_returned = True
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            outputs = [] if already_finished_and_returned else [completion]
        else:
            self.output_aggregator[completion.index] = completion
            outputs = (
                [] if self.child_requests else [o for o in self.output_aggregator if o is not None]
            )
        return outputs, not self.child_requests


class RequestState:
    """The frontend state of one engine request (vLLM's ``RequestState``)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None,
        request_index: int,
    ) -> None:
        params = request.sampling_params
        if params is None:
            raise ValueError("the text layer handles generation requests only")
        if request.prompt_token_ids is None:
            raise ValueError("the text layer needs the prompt's token ids")
        self.request_id = request.request_id
        self.external_req_id = request.external_req_id or request.request_id
        self.parent_req = parent_req
        self.request_index = request_index
        self.output_kind = params.output_kind
        self._delta = params.output_kind == RequestOutputKind.DELTA
        self._final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        if not params.detokenize:
            tokenizer = None
        self.logprobs_processor = LogprobsProcessor(tokenizer, params)
        self.detokenizer = IncrementalDetokenizer.for_request(
            tokenizer, request.prompt_token_ids, params
        )
        self.is_prefilling = True
        self.num_cached_tokens = 0
        # vLLM's stream_interval (the engine-level default is 1): outputs every N tokens.
        self.stream_interval = max(params.stream_interval or 1, 1)
        self.sent_tokens_offset = 0

    def make_request_output(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        """The output for the caller after one engine output (``None``: nothing to say)."""
        finished = finish_reason is not None
        if not finished and self._final_only:
            return None
        delta = self._delta
        detokenizer = self.detokenizer
        if self.stream_interval > 1:
            if not (
                finished
                or self.sent_tokens_offset == 0
                or detokenizer.num_output_tokens() - self.sent_tokens_offset >= self.stream_interval
            ):
                return None
            if delta:
                new_token_ids = detokenizer.output_token_ids[self.sent_tokens_offset :]
                self.sent_tokens_offset = detokenizer.num_output_tokens()
        # The completion (vLLM's _new_completion_output), built positionally: this runs
        # once per token per request.
        text = detokenizer.get_next_output_text(finished, delta)
        token_ids = new_token_ids if delta else list(detokenizer.output_token_ids)
        lp = self.logprobs_processor
        logprobs = lp.logprobs
        if logprobs is not None:
            if delta:
                logprobs = logprobs[-len(token_ids) :] if token_ids else []
            else:
                logprobs = list(logprobs)
        if finished:
            output = CompletionOutput(
                self.request_index,
                text,
                token_ids,
                lp.cumulative_logprob,
                logprobs,
                str(finish_reason),
                stop_reason,
            )
        else:
            output = CompletionOutput(
                self.request_index, text, token_ids, lp.cumulative_logprob, logprobs
            )
        external_req_id = self.external_req_id
        parent = self.parent_req
        if parent is None:
            outputs = [output]
        else:
            outputs, finished = parent.get_outputs(self.request_id, output)
            if not outputs:
                return None
            external_req_id = parent.external_req_id
        if lp.prompt_logprobs is None:
            prompt_logprobs = None
        elif delta:
            prompt_logprobs = lp.pop_prompt_logprobs()
        else:
            prompt_logprobs = lp.prompt_logprobs
        return RequestOutput(
            external_req_id,
            self.prompt,
            self.prompt_token_ids,
            prompt_logprobs,
            outputs,
            finished,
            self.num_cached_tokens,
        )


@dataclass
class OutputProcessorOutput:
    """What one call gave: outputs for the callers, and internal ids the engine must ABORT."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns engine outputs into request outputs (vLLM's ``OutputProcessor``), sans-I/O.

    Add each engine request with `add_request` before its outputs arrive (for
    ``n > 1``, each child with its `ParentRequest` and index). Not thread-safe.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self.external_req_ids: defaultdict[str, list[str]] = defaultdict(list)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.request_states

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None = None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
    ) -> RequestState:
        """Start tracking an engine request (its id must not be tracked already)."""
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already being processed")
        state = RequestState(self.tokenizer, request, prompt, parent_req, request_index)
        self.request_states[request_id] = state
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req
        self.external_req_ids[state.external_req_id].append(request_id)
        return state

    def process_outputs(
        self, engine_core_outputs: Iterable[EngineCoreOutput]
    ) -> OutputProcessorOutput:
        """Detokenize, check stop strings, build outputs; outputs of unknown (aborted)
        requests are ignored. A request whose stop string matched is finished here
        (``finish_reason="stop"``, ``stop_reason`` the string) and listed in
        ``reqs_to_abort`` when the engine had not finished it itself. An error from the
        tokenizer propagates; that request keeps the text decoded so far and the outputs
        after it in ``engine_core_outputs`` are not processed."""
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        states = self.request_states
        stop = FinishReason.STOP
        for eco in engine_core_outputs:
            req_id = eco.request_id
            state = states.get(req_id)
            if state is None:
                continue
            new_token_ids = eco.new_token_ids
            engine_finish = finish_reason = eco.finish_reason
            stop_reason = eco.stop_reason
            if state.is_prefilling:
                if eco.prefill_stats is not None:
                    state.num_cached_tokens = eco.prefill_stats.num_cached_tokens
                state.is_prefilling = False
            detokenizer = state.detokenizer
            num_prev_tokens = len(detokenizer.token_ids)
            stop_string = detokenizer.update(
                new_token_ids, finish_reason is not None and finish_reason == stop
            )
            if stop_string:
                finish_reason = stop
                stop_reason = stop_string
                num_kept = len(detokenizer.token_ids) - num_prev_tokens
                if num_kept < len(new_token_ids):
                    # Tokens after the stop string (several in one step): not ours to show.
                    new_token_ids = new_token_ids[:num_kept]
                    if eco.new_logprobs is not None:
                        eco = _with_sliced_logprobs(eco, num_kept)
            if eco.new_logprobs is not None or eco.new_prompt_logprobs_tensors is not None:
                state.logprobs_processor.update_from_output(eco)
            request_output = state.make_request_output(new_token_ids, finish_reason, stop_reason)
            if request_output is not None:
                request_outputs.append(request_output)
            if finish_reason is not None:
                self._finish_request(state)
                if engine_finish is None:
                    # We stopped it (stop string); the engine is still generating.
                    reqs_to_abort.append(req_id)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def abort_requests(
        self, request_ids: Iterable[str], *, internal: bool
    ) -> OutputProcessorOutput:
        """Forget requests (vLLM's ``abort_requests``) and give their final abort outputs.

        ``request_ids`` are internal ids (with ``internal``; a parent id aborts its
        children) or external ids (every request sent under that id). The result lists
        the internal ids to ABORT on the engine and the ``finish_reason="abort"`` outputs
        (for FINAL_ONLY with ``n > 1``: one, once the last child is aborted).
        """
        result = OutputProcessorOutput()
        internal_req_ids: list[str] = []
        for request_id in request_ids:
            if internal:
                internal_req_ids.append(request_id)
                state = self.request_states.get(request_id)
                if state is not None:
                    ids = self.external_req_ids[state.external_req_id]
                    ids.remove(request_id)
                    if not ids:
                        del self.external_req_ids[state.external_req_id]
            else:
                internal_req_ids.extend(self.external_req_ids.pop(request_id, []))
        for request_id in internal_req_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                result.reqs_to_abort.append(request_id)
                out = state.make_request_output([], FinishReason.ABORT, None)
                if out is not None:
                    result.request_outputs.append(out)
                parent = state.parent_req
                if parent is not None and not parent.child_requests:
                    self.parent_requests.pop(parent.request_id, None)
            elif (parent := self.parent_requests.get(request_id)) is not None:
                if parent.child_requests:
                    sub = self.abort_requests(list(parent.child_requests), internal=True)
                    result.reqs_to_abort.extend(sub.reqs_to_abort)
                    result.request_outputs.extend(sub.request_outputs)
                self.parent_requests.pop(request_id, None)
        return result

    def _finish_request(self, state: RequestState) -> None:
        req_id = state.request_id
        self.request_states.pop(req_id)
        ids = self.external_req_ids[state.external_req_id]
        ids.remove(req_id)
        if not ids:
            del self.external_req_ids[state.external_req_id]
        parent = state.parent_req
        if parent is not None and not parent.child_requests:
            self.parent_requests.pop(parent.request_id, None)


def _with_sliced_logprobs(eco: EngineCoreOutput, num_kept: int) -> EngineCoreOutput:
    """A copy of ``eco`` with only the first ``num_kept`` rows of sample logprobs."""
    import msgspec

    lp = eco.new_logprobs
    assert lp is not None
    sliced = msgspec.structs.replace(
        lp,
        logprob_token_ids=lp.logprob_token_ids[:num_kept],
        logprobs=lp.logprobs[:num_kept],
        sampled_token_ranks=lp.sampled_token_ranks[:num_kept],
        cu_num_generated_tokens=None,
    )
    return msgspec.structs.replace(eco, new_logprobs=sliced)
