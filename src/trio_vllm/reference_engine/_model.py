"""The reference engine's models: ``echo`` (exactly predictable) and ``tiny`` (a real transformer).

Both share one byte-level vocabulary: ids 0-255 are bytes, then four specials
(:data:`BOS_TOKEN_ID`, :data:`EOS_TOKEN_ID`, :data:`PAD_TOKEN_ID`, :data:`UNK_TOKEN_ID`).
Both return next-token logits for a batch of sequences as a float32 NumPy array, so the
sampler (``_sampler.py``) is the same for both.

The echo model's rule (the one tests rely on): after a sequence ``s`` of length ``n``
whose first ``P`` tokens are the prompt, the next token is ``s[n mod P]``. So the
generated text repeats the prompt from its start, and on prompt positions the model
predicts the actual next prompt token. Its logits are ``0.0`` for that token and
``-100.0`` for every other id, so greedy and seeded sampling at any temperature pick it
(unless a processor masks it). At a ``prompt_embeds`` position the prompt "token" is
``int(round(e[0])) mod vocab_size`` of that position's embedding vector ``e``. Its hidden state
at a position is the one-hot vector of ``token mod HIDDEN_SIZE``. The echo model never
imports torch.

The tiny model is a 2-layer decoder-only transformer (hidden 64, 4 heads, learned
positions, tied embeddings) whose weights come from ``torch.Generator().manual_seed(seed)``.
It recomputes the whole sequence on each step (no KV cache), batched with right padding
and a causal mask, so greedy output depends only on seed, device and batch composition.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "HIDDEN_SIZE",
    "PAD_TOKEN_ID",
    "UNK_TOKEN_ID",
    "VOCAB_SIZE",
    "EchoModel",
    "Model",
    "Sequence",
    "TinyModel",
    "load_model",
]

BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
UNK_TOKEN_ID = 259
VOCAB_SIZE = 260
HIDDEN_SIZE = 64
_ECHO_OTHER_LOGIT = -100.0


@dataclass(eq=False)
class Sequence:
    """What the model sees of one request: its tokens and, optionally, prompt embeddings.

    ``token_ids`` holds prompt then output ids; at a position fed by ``prompt_embeds`` the
    id is a placeholder (0) and ``embed_mask[pos]`` is true.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    prompt_embeds: npt.NDArray[np.float32] | None = None
    embed_mask: npt.NDArray[np.bool_] | None = None
    vocab_size: int = VOCAB_SIZE
    _echo_prompt: list[int] | None = field(default=None, repr=False)

    def echo_prompt(self) -> list[int]:
        """The prompt as the echo model reads it (embedding positions mapped to ids)."""
        if self._echo_prompt is None:
            prompt = list(self.token_ids[: self.num_prompt_tokens])
            if self.prompt_embeds is not None and self.embed_mask is not None:
                for pos in np.flatnonzero(self.embed_mask):
                    prompt[int(pos)] = round(float(self.prompt_embeds[pos, 0])) % self.vocab_size
            self._echo_prompt = prompt
        return self._echo_prompt


class Model(Protocol):
    """What the scheduler needs from a model. Methods raise only on engine bugs."""

    name: str
    dtype: str
    device: str
    vocab_size: int
    hidden_size: int

    def next_token_logits(self, seqs: list[Sequence]) -> npt.NDArray[np.float32]: ...

    def greedy_next_tokens(self, seqs: list[Sequence]) -> list[int] | None: ...

    def prompt_logits(self, seq: Sequence) -> npt.NDArray[np.float32]: ...

    def hidden_states(self, seq: Sequence) -> npt.NDArray[np.float32]: ...

    def embed_tokens(self, token_ids: list[int]) -> npt.NDArray[np.float32]: ...

    def offload(self, level: int) -> None: ...

    def reload(self) -> None: ...

    def weight_checksums(self) -> dict[str, str]: ...

    def save(self, path: str, rank: int) -> None: ...


class EchoModel:
    """The deterministic model described in the module docstring (no torch).

    ``vocab_size`` only sets the logits' width (``--model-dir``): echoing works for any.
    """

    name = "echo"
    dtype = "float32"
    device = "cpu"
    hidden_size = HIDDEN_SIZE

    def __init__(self, vocab_size: int = VOCAB_SIZE) -> None:
        self.vocab_size = vocab_size

    def next_token(self, seq: Sequence) -> int:
        prompt = seq.echo_prompt()
        n = len(seq.token_ids)
        pos = n % len(prompt)
        return prompt[pos]

    def greedy_next_tokens(self, seqs: list[Sequence]) -> list[int] | None:
        return [self.next_token(seq) for seq in seqs]

    def next_token_logits(self, seqs: list[Sequence]) -> npt.NDArray[np.float32]:
        logits = np.full((len(seqs), self.vocab_size), _ECHO_OTHER_LOGIT, dtype=np.float32)
        for row, seq in enumerate(seqs):
            logits[row, self.next_token(seq)] = 0.0
        return logits

    def prompt_logits(self, seq: Sequence) -> npt.NDArray[np.float32]:
        prompt = seq.echo_prompt()
        p = len(prompt)
        logits = np.full((p, self.vocab_size), _ECHO_OTHER_LOGIT, dtype=np.float32)
        for pos in range(p):
            logits[pos, prompt[(pos + 1) % p]] = 0.0
        return logits

    def hidden_states(self, seq: Sequence) -> npt.NDArray[np.float32]:
        prompt = seq.echo_prompt()
        hidden = np.zeros((len(prompt), HIDDEN_SIZE), dtype=np.float32)
        hidden[np.arange(len(prompt)), np.asarray(prompt) % HIDDEN_SIZE] = 1.0
        return hidden

    def embed_tokens(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        """Embeddings the echo model maps back to ``token_ids`` (``e[0]`` = the id)."""
        out = np.zeros((len(token_ids), HIDDEN_SIZE), dtype=np.float32)
        out[:, 0] = token_ids
        return out

    def offload(self, level: int) -> None:
        pass

    def reload(self) -> None:
        pass

    def weight_checksums(self) -> dict[str, str]:
        return {"echo": hashlib.sha256(b"echo").hexdigest()}

    def save(self, path: str, rank: int) -> None:
        import os

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, f"model-rank-{rank}-part-0.echo"), "w") as file:
            file.write("echo\n")


class TinyModel:
    """A 2-layer transformer built in torch from a fixed seed (see the module docstring)."""

    name = "tiny"
    hidden_size = HIDDEN_SIZE
    num_layers = 2
    num_heads = 4

    def __init__(
        self, *, seed: int, device: str, max_model_len: int, vocab_size: int = VOCAB_SIZE
    ) -> None:
        import torch

        self._torch = torch
        self.vocab_size = vocab_size
        self.seed = seed
        self.device = device
        self.dtype = "float32"
        self.max_positions = max_model_len
        self._params: dict[str, Any] | None = None
        self._build()

    def _build(self) -> None:
        torch = self._torch
        gen = torch.Generator().manual_seed(self.seed)
        h, v = HIDDEN_SIZE, self.vocab_size

        def normal(*shape: int, std: float) -> Any:
            return torch.randn(*shape, generator=gen) * std

        params: dict[str, Any] = {
            "embed": normal(v, h, std=1.0),
            "pos": normal(self.max_positions, h, std=0.3),
            "final_ln_w": torch.ones(h),
            "final_ln_b": torch.zeros(h),
            "lm_head": normal(h, v, std=2.0 / math.sqrt(h)),
        }
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            params[p + "ln1_w"] = torch.ones(h)
            params[p + "ln1_b"] = torch.zeros(h)
            params[p + "qkv"] = normal(h, 3 * h, std=1.0 / math.sqrt(h))
            params[p + "out"] = normal(h, h, std=1.0 / math.sqrt(h))
            params[p + "ln2_w"] = torch.ones(h)
            params[p + "ln2_b"] = torch.zeros(h)
            params[p + "up"] = normal(h, 4 * h, std=1.0 / math.sqrt(h))
            params[p + "down"] = normal(4 * h, h, std=1.0 / math.sqrt(4 * h))
        self._params = {name: t.to(self.device) for name, t in params.items()}

    def _inputs(self, seqs: list[Sequence]) -> tuple[Any, list[int]]:
        """Embedded, right-padded batch ``[B, L, H]`` and the real length of each row."""
        torch = self._torch
        assert self._params is not None, "weights are discarded (sleep level 2)"
        lengths = [len(s.token_ids) for s in seqs]
        width = max(lengths)
        pad = min(PAD_TOKEN_ID, self.vocab_size - 1)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, : lengths[row]] = torch.tensor(seq.token_ids, dtype=torch.long)
        x = self._params["embed"][ids.to(self.device)]
        for row, seq in enumerate(seqs):
            if seq.prompt_embeds is not None and seq.embed_mask is not None:
                mask = torch.from_numpy(seq.embed_mask).to(self.device)
                emb = torch.from_numpy(seq.prompt_embeds).to(self.device, torch.float32)
                p = seq.num_prompt_tokens
                x[row, :p][mask] = emb[mask]
        positions = torch.arange(width, device=self.device) % self.max_positions
        return x + self._params["pos"][positions], lengths

    def _forward(self, x: Any) -> Any:
        torch = self._torch
        functional = torch.nn.functional
        assert self._params is not None
        params = self._params
        b, length, h = x.shape
        heads, hd = self.num_heads, h // self.num_heads
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            y = functional.layer_norm(x, (h,), params[p + "ln1_w"], params[p + "ln1_b"])
            q, k, v = (y @ params[p + "qkv"]).split(h, dim=-1)
            q = q.view(b, length, heads, hd).transpose(1, 2)
            k = k.view(b, length, heads, hd).transpose(1, 2)
            v = v.view(b, length, heads, hd).transpose(1, 2)
            att = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + att.transpose(1, 2).reshape(b, length, h) @ params[p + "out"]
            y = functional.layer_norm(x, (h,), params[p + "ln2_w"], params[p + "ln2_b"])
            x = x + functional.gelu(y @ params[p + "up"]) @ params[p + "down"]
        return functional.layer_norm(x, (h,), params["final_ln_w"], params["final_ln_b"])

    def next_token_logits(self, seqs: list[Sequence]) -> npt.NDArray[np.float32]:
        torch = self._torch
        with torch.inference_mode():
            x, lengths = self._inputs(seqs)
            hidden = self._forward(x)
            rows = torch.arange(len(seqs), device=self.device)
            last = hidden[rows, torch.tensor(lengths, device=self.device) - 1]
            logits = last @ self._params["lm_head"]  # type: ignore[index]
            return logits.float().cpu().numpy()  # type: ignore[no-any-return]

    def greedy_next_tokens(self, seqs: list[Sequence]) -> list[int] | None:
        return None

    def _prompt_hidden(self, seq: Sequence, *, logits: bool) -> npt.NDArray[np.float32]:
        """Forward the prompt part of ``seq`` alone; hidden states, or logits."""
        prompt_only = Sequence(
            list(seq.token_ids[: seq.num_prompt_tokens]),
            seq.num_prompt_tokens,
            seq.prompt_embeds,
            seq.embed_mask,
            seq.vocab_size,
        )
        with self._torch.inference_mode():
            x, _ = self._inputs([prompt_only])
            out = self._forward(x)[0]
            if logits:
                out = out @ self._params["lm_head"]  # type: ignore[index]
            return out.float().cpu().numpy()  # type: ignore[no-any-return]

    def prompt_logits(self, seq: Sequence) -> npt.NDArray[np.float32]:
        return self._prompt_hidden(seq, logits=True)

    def hidden_states(self, seq: Sequence) -> npt.NDArray[np.float32]:
        return self._prompt_hidden(seq, logits=False)

    def embed_tokens(self, token_ids: list[int]) -> npt.NDArray[np.float32]:
        assert self._params is not None, "weights are discarded (sleep level 2)"
        ids = self._torch.tensor(token_ids, dtype=self._torch.long, device=self.device)
        return self._params["embed"][ids].float().cpu().numpy()  # type: ignore[no-any-return]

    def offload(self, level: int) -> None:
        if level >= 2:
            self._params = None
        elif self._params is not None:
            self._params = {name: t.to("cpu") for name, t in self._params.items()}

    def reload(self) -> None:
        if self._params is None:
            # Level 2 discarded the weights; vLLM would need reload_weights. Rebuilding from
            # the seed keeps the engine usable and its output identical.
            self._build()
        else:
            self._params = {name: t.to(self.device) for name, t in self._params.items()}

    def weight_checksums(self) -> dict[str, str]:
        if self._params is None:
            return {}
        return {
            name: hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()
            for name, t in self._params.items()
        }

    def save(self, path: str, rank: int) -> None:
        import os

        os.makedirs(path, exist_ok=True)
        assert self._params is not None, "weights are discarded (sleep level 2)"
        self._torch.save(
            {name: t.cpu() for name, t in self._params.items()},
            os.path.join(path, f"model-rank-{rank}-part-0.pt"),
        )


def resolve_device(device: str) -> str:
    """``auto`` means cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    name: str, *, seed: int, device: str, max_model_len: int, vocab_size: int = VOCAB_SIZE
) -> Model:
    """Build the model named by ``--model``; torch is imported only for ``tiny``."""
    if name == "echo":
        return EchoModel(vocab_size)
    if name == "tiny":
        import torch

        torch.set_num_threads(1)
        return TinyModel(
            seed=seed,
            device=resolve_device(device),
            max_model_len=max_model_len,
            vocab_size=vocab_size,
        )
    raise ValueError(f"unknown model {name!r} (choose echo or tiny)")
