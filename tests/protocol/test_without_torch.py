"""``import trio_vllm`` and every non-tensor message work where torch cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from ._vectors import VECTORS_ROOT

_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
            return None

    sys.meta_path.insert(0, BlockTorch())
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[name]

    import numpy as np
    import trio_vllm
    from trio_vllm.protocol import (
        ClientCodec, EngineCodec, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
        LogprobsLists, RawTensor, SamplingParams, torch_available,
    )

    assert "torch" not in sys.modules
    req = EngineCoreRequest("r", prompt_token_ids=[1, 2],
                            sampling_params=SamplingParams(max_tokens=3, temperature=0))
    frames = ClientCodec().encode_add(req)
    assert EngineCodec().decode_input(frames).prompt_token_ids == [1, 2]
    lp = LogprobsLists(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32),
                       np.zeros(2, np.int32))
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5, 6], new_logprobs=lp)])
    back = ClientCodec().decode_outputs(EngineCodec().encode_outputs(outs))
    assert back.outputs[0].new_token_ids == [5, 6]
    assert back.outputs[0].new_logprobs.logprobs.shape == (2, 3)
    assert "torch" not in sys.modules, "a message without tensors imported torch"

    # Tensor fields fall back to numpy, or RawTensor for dtypes numpy lacks.
    assert not torch_available()
    outs = EngineCoreOutputs(outputs=[
        EngineCoreOutput("a", [], pooling_output=np.arange(4, dtype=np.float32)),
        EngineCoreOutput("b", [],
                         pooling_output=RawTensor("bfloat16", (2,), b"\\x80?\\x00@")),
    ])
    a, b = ClientCodec().decode_outputs(EngineCodec().encode_outputs(outs)).outputs
    assert isinstance(a.pooling_output, np.ndarray) and a.pooling_output.tolist() == [0, 1, 2, 3]
    assert isinstance(b.pooling_output, RawTensor) and b.pooling_output.dtype == "bfloat16"

    if len(sys.argv) > 1:
        from trio_vllm._wirecheck import run_wire_check
        dirs = [sys.argv[1] + "/vllm-" + r for r in ("0.25.1", "0.32.0", "0.33.0")]
        assert run_wire_check(dirs, verbose=False) == 0
    print("OK")
    """
)


def test_protocol_without_torch() -> None:
    args = [sys.executable, "-c", _SCRIPT]
    if VECTORS_ROOT.is_dir():
        args.append(str(VECTORS_ROOT))
    proc = subprocess.run(args, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "OK"
