"""Codec behaviour beyond the captured vectors: tensors, zero copy, profiles, refusals."""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from trio_vllm import InsecureSerializationError, ProtocolError
from trio_vllm.protocol import (
    ENGINE_CORE_DEAD,
    V0_25_1,
    V0_32_0,
    V0_33_0,
    AbortRequests,
    ClientCodec,
    EngineCodec,
    EngineCoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
    LogprobsTensors,
    LoRARequest,
    PoolingParams,
    RawTensor,
    SamplingParams,
    StartDPWave,
    UtilityCall,
    UtilityOutput,
    UtilityResult,
    profile_for_version,
)

PROFILES = [V0_25_1, V0_32_0, V0_33_0]


def _request(**kw: Any) -> EngineCoreRequest:
    kw.setdefault("prompt_token_ids", [1, 2, 3])
    kw.setdefault("sampling_params", SamplingParams(max_tokens=4, temperature=0))
    return EngineCoreRequest("r1", arrival_time=1.5, **kw)


def _roundtrip(profile: Any, request: EngineCoreRequest) -> EngineCoreRequest:
    frames = ClientCodec(profile).encode_add(request)
    decoded = EngineCodec(profile).decode_input(frames)
    assert isinstance(decoded, EngineCoreRequest)
    return decoded


class _Frame:
    """Looks like a zmq.Frame: exposes its bytes as ``.buffer``."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


# ---- client -> engine ------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.vllm_version)
def test_add_roundtrip_every_profile(profile: Any) -> None:
    req = _request(
        lora_request=LoRARequest("a", 3, "/l/a"),
        cache_salt="s",
        priority=-2,
        trace_headers={"t": "1"},
    )
    frames = ClientCodec(profile).encode_add(req)
    assert frames[0] == b"\x00"
    body = msgspec.msgpack.decode(frames[1])
    assert len(body) == len(profile.layouts["EngineCoreRequest"])
    assert len(body[6]) == len(profile.layouts["LoRARequest"])
    back = _roundtrip(profile, req)
    assert back.lora_request == req.lora_request
    assert back.sampling_params == req.sampling_params
    assert (back.cache_salt, back.priority, back.trace_headers) == ("s", -2, {"t": "1"})


def test_lora_layout_0_25_puts_tensorizer_at_index_4() -> None:
    lora = LoRARequest("a", 3, "/l/a", tensorizer_config_dict={"k": 1})
    frames = ClientCodec(V0_25_1).encode_utility(0, 5, "add_lora", [lora])
    _, _, _, args = msgspec.msgpack.decode(frames[1])
    assert args[0] == ["a", 3, "/l/a", None, {"k": 1}, False, False]
    call = EngineCodec(V0_25_1).decode_input(frames)
    assert isinstance(call, UtilityCall)
    assert EngineCodec(V0_25_1).convert_lora_request(call.args[0]) == lora


def test_pooling_layout_grows_in_0_33() -> None:
    req = _request(sampling_params=None, pooling_params=PoolingParams(task="embed"))
    for profile, length in ((V0_32_0, 10), (V0_33_0, 11)):
        body = msgspec.msgpack.decode(ClientCodec(profile).encode_add(req)[1])
        assert len(body[4]) == length


@pytest.mark.parametrize(
    ("shape", "inline"), [((63,), True), ((64,), False), ((0, 8), True), ((3, 4), True)]
)
def test_prompt_embeds_inline_threshold(shape: tuple[int, ...], inline: bool) -> None:
    embeds = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape)
    req = _request(prompt_token_ids=None, prompt_embeds=embeds)
    if 0 in shape:
        with pytest.raises(ValueError, match="prompt_embeds"):
            ClientCodec().encode_add(req)
        frames = ClientCodec().encode_add(req, validate=False)
    else:
        frames = ClientCodec().encode_add(req)
    assert len(frames) == (2 if inline else 3)
    back = EngineCodec().decode_input(frames)
    assert isinstance(back, EngineCoreRequest)
    assert isinstance(back.prompt_embeds, torch.Tensor)
    assert back.prompt_embeds.dtype == torch.float32
    assert torch.equal(back.prompt_embeds, embeds)


def test_bfloat16_and_numpy_embeds() -> None:
    bf = torch.tensor([[0.5, -1.25], [3.0, 8.0]], dtype=torch.bfloat16)
    back = _roundtrip(V0_32_0, _request(prompt_token_ids=None, prompt_embeds=bf))
    assert back.prompt_embeds.dtype == torch.bfloat16
    assert torch.equal(back.prompt_embeds, bf)
    # A numpy array in a torch-typed field travels with the torch dtype name.
    arr = np.ones((2, 3), dtype=np.float16)
    frames = ClientCodec().encode_add(_request(prompt_token_ids=None, prompt_embeds=arr))
    assert msgspec.msgpack.decode(frames[1])[9][0] == "float16"


def test_add_frames_do_not_copy_large_tensor() -> None:
    arr = torch.zeros((64, 64), dtype=torch.float32)
    frames = ClientCodec().encode_add(_request(prompt_token_ids=None, prompt_embeds=arr))
    aux = frames[2]
    assert isinstance(aux, memoryview)
    assert aux.nbytes == arr.numel() * 4
    arr[0, 0] = 7.0  # the frame is a view of the tensor's memory
    assert np.frombuffer(aux, dtype=np.float32)[0] == 7.0


def test_abort_utility_wave_roundtrip() -> None:
    client, engine = ClientCodec(), EngineCodec()
    assert engine.decode_input(client.encode_abort(["a", "b"])) == AbortRequests(["a", "b"])
    big = (1 << 64) - 1
    call = engine.decode_input(client.encode_utility(0, big, "sleep", [1, "wait"]))
    assert call == UtilityCall(0, big, "sleep", [1, "wait"])
    assert engine.decode_input(client.encode_start_dp_wave(3, None)) == StartDPWave(3, None)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 1, "m", []), "client_index"),
        ((0, -1, "m", []), "reserved"),
        ((0, -2, "m", []), "reserved"),
        ((0, 1 << 64, "m", []), "call_id"),
        ((0, 1, "", []), "method"),
        ((0, 1, "m", "ab"), "args"),
        ((0, 1, "m", [object()]), "cannot be encoded"),
    ],
)
def test_encode_utility_refuses(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClientCodec().encode_utility(*args)


def test_reserved_call_ids_depend_on_release() -> None:
    ClientCodec(V0_25_1).encode_utility(0, -2, "m", [])  # only -1 is reserved in 0.25.1
    with pytest.raises(ValueError, match="reserved"):
        ClientCodec(V0_32_0).encode_utility(0, -2, "m", [])


def test_encode_abort_refuses_a_plain_string() -> None:
    with pytest.raises(TypeError):
        ClientCodec().encode_abort("abc")


# ---- engine -> client ------------------------------------------------------------------


def _outputs_with_logprobs(n_tokens: int) -> EngineCoreOutputs:
    ids = np.arange(n_tokens * 8, dtype=np.int32).reshape(n_tokens, 8)
    lps = -np.arange(n_tokens * 8, dtype=np.float32).reshape(n_tokens, 8)
    ranks = np.arange(n_tokens, dtype=np.int32)
    prompt = LogprobsTensors(
        torch.zeros((4, 3), dtype=torch.int64),
        torch.full((4, 3), -1.0),
        torch.ones(4, dtype=torch.int64),
    )
    return EngineCoreOutputs(
        engine_index=1,
        outputs=[
            EngineCoreOutput(
                "r1",
                list(range(n_tokens)),
                new_logprobs=LogprobsLists(ids, lps, ranks, [0, n_tokens]),
                new_prompt_logprobs_tensors=prompt,
                finish_reason=FinishReason.LENGTH,
                stop_reason=None,
            )
        ],
        timestamp=2.5,
        finished_requests={"r1"},
    )


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.vllm_version)
def test_outputs_roundtrip_with_aux_frames(profile: Any) -> None:
    outs = _outputs_with_logprobs(64)
    frames = EngineCodec(profile).encode_outputs(outs)
    assert len(frames) == 4  # main + three ndarrays >= 256 bytes
    body = msgspec.msgpack.decode(frames[0])
    assert len(body) == len(profile.layouts["EngineCoreOutputs"])
    assert len(body[1][0]) == len(profile.layouts["EngineCoreOutput"])
    back = ClientCodec(profile).decode_outputs([bytes(f) for f in frames])
    assert isinstance(back, EngineCoreOutputs)
    out = back.outputs[0]
    assert out.finished
    assert out.finish_reason is FinishReason.LENGTH
    lp = out.new_logprobs
    assert lp is not None
    sent = outs.outputs[0].new_logprobs
    assert sent is not None
    np.testing.assert_array_equal(lp.logprob_token_ids, sent.logprob_token_ids)
    np.testing.assert_array_equal(lp.logprobs, sent.logprobs)
    assert lp.cu_num_generated_tokens == [0, 64]
    prompt = out.new_prompt_logprobs_tensors
    assert prompt is not None
    assert isinstance(prompt.logprobs, torch.Tensor)
    assert torch.equal(prompt.logprobs, torch.full((4, 3), -1.0))
    assert back.finished_requests == {"r1"}


def test_decoded_arrays_are_views_of_the_frames() -> None:
    frames = EngineCodec().encode_outputs(_outputs_with_logprobs(64))
    received = [bytearray(f) for f in frames]  # writable, like a reused receive buffer
    back = ClientCodec().decode_outputs(received)
    assert isinstance(back, EngineCoreOutputs)
    lp = back.outputs[0].new_logprobs
    assert lp is not None
    assert np.shares_memory(lp.logprobs, np.frombuffer(received[2], dtype=np.uint8))
    assert not lp.logprobs.flags.writeable or lp.logprobs.base is not None


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, _Frame])
def test_frames_of_any_buffer_type(kind: Any) -> None:
    frames = EngineCodec().encode_outputs(_outputs_with_logprobs(64))
    back = ClientCodec().decode_outputs([kind(bytes(f)) for f in frames])
    assert isinstance(back, EngineCoreOutputs)
    assert back.outputs[0].new_token_ids == list(range(64))
    assert isinstance(ClientCodec().decode_outputs([kind(ENGINE_CORE_DEAD)]), EngineCoreDead)


def test_engine_core_dead_only_as_single_frame() -> None:
    assert ClientCodec().decode_outputs([ENGINE_CORE_DEAD]) is EngineCoreDead()
    with pytest.raises(ProtocolError):
        ClientCodec().decode_outputs([ENGINE_CORE_DEAD, b""])
    assert EngineCodec().encode_dead() == [ENGINE_CORE_DEAD]


def test_missing_aux_frame_is_a_protocol_error() -> None:
    frames = EngineCodec().encode_outputs(_outputs_with_logprobs(64))
    with pytest.raises(ProtocolError, match="aux frame 3"):
        ClientCodec().decode_outputs(frames[:3])


def test_wrong_size_tensor_is_a_protocol_error() -> None:
    frames = EngineCodec().encode_outputs(_outputs_with_logprobs(64))
    with pytest.raises(ProtocolError, match="needs 2048 bytes"):
        ClientCodec().decode_outputs([frames[0], frames[1][:-4], frames[2], frames[3]])


def test_0_32_decoder_rejects_0_25_output_and_vice_versa() -> None:
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1], routed_experts=None)])
    old = EngineCodec(V0_25_1).encode_outputs(outs)
    assert ClientCodec(V0_25_1).decode_outputs(old) == outs
    new = EngineCodec(V0_32_0).encode_outputs(outs)
    with pytest.raises(ProtocolError):
        ClientCodec(V0_25_1).decode_outputs(new)


def test_newer_release_with_appended_fields_decodes() -> None:
    # A hypothetical 0.34 appends a field to EngineCoreOutput and EngineCoreOutputs.
    body = msgspec.msgpack.decode(
        EngineCodec(V0_33_0).encode_outputs(
            EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5])], timestamp=1.0)
        )[0]
    )
    body[1][0].append({"new": 1})
    body.append("extra")
    with pytest.warns(RuntimeWarning, match="newer"):
        profile = profile_for_version("0.34.0")
    out = ClientCodec(profile).decode_outputs([msgspec.msgpack.encode(body)])
    assert isinstance(out, EngineCoreOutputs)
    assert out.outputs[0].new_token_ids == [5]


def _utility_frames(result: Any) -> list[bytes]:
    outs = EngineCoreOutputs(utility_output=UtilityOutput(7, None, result), timestamp=0.0)
    return [bytes(f) for f in EngineCodec().encode_outputs(outs)]


def test_typed_utility_result_refused_unless_allowed() -> None:
    frames = _utility_frames(UtilityResult(["builtins", "tuple"], [1, 2]))
    with pytest.raises(InsecureSerializationError):
        ClientCodec().decode_outputs(frames)
    out = ClientCodec(allow_insecure_serialization=True).decode_outputs(frames)
    assert isinstance(out, EngineCoreOutputs)
    assert out.utility_output is not None
    assert out.utility_output.result == UtilityResult(["builtins", "tuple"], (1, 2))


def test_plain_utility_result() -> None:
    out = ClientCodec().decode_outputs(_utility_frames(UtilityResult(None, {"a": [1]})))
    assert isinstance(out, EngineCoreOutputs)
    assert out.utility_output is not None
    assert out.utility_output.result == UtilityResult(None, {"a": [1]})


@pytest.mark.parametrize("code", [1, 2])
def test_pickle_extension_refused_unless_allowed(code: int) -> None:
    payload = msgspec.msgpack.Ext(code, pickle.dumps({"x": 1}))
    main = msgspec.msgpack.encode([0, [], None, 1.0, [3, None, [None, payload]]])
    with pytest.raises(InsecureSerializationError, match="pickle"):
        ClientCodec().decode_outputs([main])
    out = ClientCodec(allow_insecure_serialization=True).decode_outputs([main])
    assert isinstance(out, EngineCoreOutputs)
    assert out.utility_output is not None
    assert out.utility_output.result == UtilityResult(None, {"x": 1})


def test_unknown_extension_type_is_a_protocol_error() -> None:
    ext = msgspec.msgpack.Ext(9, b"")
    main = msgspec.msgpack.encode([0, [], None, 1.0, [3, None, [None, ext]]])
    with pytest.raises(ProtocolError, match="extension type 9"):
        ClientCodec().decode_outputs([main])


def test_empty_tensor_and_raw_tensor_outputs() -> None:
    outs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [], pooling_output=torch.empty((0, 4))),
            EngineCoreOutput("b", [], pooling_output=RawTensor("bfloat16", (2,), b"\x80?\x00@")),
            EngineCoreOutput("c", [], pooling_output=np.arange(3, dtype=np.float32)),
        ],
        timestamp=0.0,
    )
    frames = EngineCodec().encode_outputs(outs)
    body = msgspec.msgpack.decode(frames[0])
    assert body[1][2][4][0] == "float32"  # numpy array in a torch field: torch dtype name
    back = ClientCodec().decode_outputs(frames)
    assert isinstance(back, EngineCoreOutputs)
    a, b, c = (o.pooling_output for o in back.outputs)
    assert a.shape == (0, 4)
    assert b.dtype == torch.bfloat16
    assert b.tolist() == [1.0, 2.0]
    assert c.tolist() == [0.0, 1.0, 2.0]


def test_codecs_are_reusable_after_errors() -> None:
    client = ClientCodec()
    good = EngineCodec().encode_outputs(_outputs_with_logprobs(64))
    for _ in range(3):
        with pytest.raises(ProtocolError):
            client.decode_outputs([b"\xc1"])
        assert isinstance(client.decode_outputs(good), EngineCoreOutputs)


def test_protocol_errors_name_the_message_and_the_place() -> None:
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1])], timestamp=0.0)
    body = msgspec.msgpack.decode(EngineCodec().encode_outputs(outs)[0])
    body[1][0][5] = "stop"  # finish_reason must be an int
    with pytest.raises(ProtocolError) as info:
        ClientCodec().decode_outputs([msgspec.msgpack.encode(body)])
    message = str(info.value)
    assert "EngineCoreOutputs" in message
    assert "0.33.0" in message
    assert "$[1][0][5]" in message
    with pytest.raises(ProtocolError, match=r"ADD \(EngineCoreRequest\)"):
        EngineCodec().decode_input([b"\x00", msgspec.msgpack.encode([1] * 9)])


@pytest.mark.parametrize("shape", [[-1], [-1, 8], [8, -1], [2, 2], [True, 4]])
def test_ndarray_shape_must_match_exactly(shape: list[Any]) -> None:
    triple = ["<f4", shape, msgspec.msgpack.Ext(3, bytes(16 * 4))]
    out = ["r", [1], [triple, triple, triple, None]]
    main = msgspec.msgpack.encode([0, [out], None, 1.0])
    with pytest.raises(ProtocolError):
        ClientCodec().decode_outputs([main])


def test_tensor_field_with_numpy_dtype_label_is_accepted() -> None:
    triple = ["<f4", [2], msgspec.msgpack.Ext(3, np.array([1.5, 2.5], np.float32).tobytes())]
    out = ["r", [], None, None, triple]
    back = ClientCodec().decode_outputs([msgspec.msgpack.encode([0, [out], None, 1.0])])
    assert isinstance(back, EngineCoreOutputs)
    pooled = back.outputs[0].pooling_output
    assert isinstance(pooled, torch.Tensor)
    assert pooled.dtype == torch.float32
    assert pooled.tolist() == [1.5, 2.5]
