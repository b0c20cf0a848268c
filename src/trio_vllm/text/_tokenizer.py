"""A model directory's tokenizer, generation config and model config (sans-I/O but for reads).

What vLLM reads through ``transformers`` (``AutoTokenizer``, ``GenerationConfig``,
``AutoConfig``), read here straight from the JSON files:

* ``tokenizer.json`` through the HF ``tokenizers`` library (imported lazily);
* ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``...),
  ``additional_special_tokens`` / ``extra_special_tokens``, ``added_tokens_decoder``,
  ``chat_template``, ``add_bos_token`` / ``add_eos_token`` (only where ``tokenizer.json``
  has no post-processor, as transformers v5 does), ``clean_up_tokenization_spaces``;
* ``generation_config.json`` (vLLM's ``try_get_generation_config``: the EOS id list and
  the sampling defaults); without it, ``config.json``'s token ids, as transformers'
  ``GenerationConfig.from_model_config`` does;
* ``config.json``: ``vocab_size``, ``max_position_embeddings``.

A directory without ``tokenizer.json`` falls back to ``transformers.AutoTokenizer`` when
``transformers`` is installed. A name that is not a directory is looked up with
``huggingface_hub`` in the local cache (``HF_HUB_OFFLINE=1`` never touches the network).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from ._defaults import SamplingDefaults

if TYPE_CHECKING:
    import tokenizers

__all__ = ["ModelFiles", "Tokenizer", "load_tokenizer"]

_CONFIG_FILES: Final = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_NAMED_SPECIAL: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _generation_config(folder: Path, model_config: Mapping[str, Any]) -> dict[str, Any]:
    generation = _read_json(folder / "generation_config.json")
    if not generation:
        # transformers' GenerationConfig.from_model_config: the token ids of config.json.
        generation = {
            k: model_config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if model_config.get(k) is not None
        }
    return generation


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def resolve_model_dir(model: str | os.PathLike[str]) -> Path:
    """A local directory for ``model``: the path itself, or a hub name from the local cache.

    Hub names go through ``huggingface_hub.snapshot_download`` for the configuration and
    tokenizer files only (never the weights). With ``HF_HUB_OFFLINE=1`` (or no network)
    only what is already cached is used. Raises ``FileNotFoundError`` when neither works.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = os.fspath(model)
    if path.exists() or name.count("/") > 1 or not name:
        raise FileNotFoundError(f"model directory {name!r} does not exist")
    try:
        import huggingface_hub
    except ImportError:
        raise FileNotFoundError(
            f"{name!r} is not a directory, and huggingface_hub is not installed to look it up "
            "as a hub name (pip install huggingface_hub, or pass a local model directory)"
        ) from None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        snapshot = huggingface_hub.snapshot_download(
            name, allow_patterns=list(_CONFIG_FILES), local_files_only=offline
        )
    except Exception as exc:  # the hub's error classes vary between releases
        hint = " (HF_HUB_OFFLINE is set: only the local cache was searched)" if offline else ""
        raise FileNotFoundError(
            f"{name!r} is not a local directory and could not be found on the hub{hint}: {exc}"
        ) from exc
    return Path(snapshot)


class ModelFiles:
    """The JSON files of a model directory, read once (vLLM's model/generation config).

    ``config``, ``tokenizer_config`` and ``generation_config`` are the parsed files (an
    empty dict when a file is missing). ``generation_config`` is vLLM's
    ``--generation-config``: ``"auto"`` (the model's file), ``"vllm"`` (the model's file
    for EOS ids, no sampling defaults) or a directory whose ``generation_config.json``
    replaces the model's; ``override_generation_config`` is
    ``--override-generation-config`` (see `sampling_defaults`). Construction reads files
    (``FileNotFoundError`` for a missing directory, ``ValueError`` for a bad file or
    value); nothing else does I/O except `load_tokenizer`.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        generation_config: str | os.PathLike[str] = "auto",
        override_generation_config: Mapping[str, object] | None = None,
    ) -> None:
        self.path: Path = resolve_model_dir(model)
        self.config: dict[str, Any] = _read_json(self.path / "config.json")
        # Multimodal configs nest the language model's config.
        text_config = self.config.get("text_config")
        self.text_config: dict[str, Any] = (
            text_config if isinstance(text_config, dict) else self.config
        )
        self.tokenizer_config: dict[str, Any] = _read_json(self.path / "tokenizer_config.json")
        source = os.fspath(generation_config)
        if source in ("auto", "vllm"):
            self.generation_config: dict[str, Any] = _generation_config(self.path, self.text_config)
        else:
            # vLLM's --generation-config DIR: EOS ids and sampling defaults come from there.
            folder = Path(source).expanduser()
            if not folder.is_dir():
                raise FileNotFoundError(f"generation config directory {source!r} does not exist")
            folder_config = _read_json(folder / "config.json")
            nested = folder_config.get("text_config")
            self.generation_config = _generation_config(
                folder, nested if isinstance(nested, dict) else folder_config
            )
        self.generation_config_source = source
        self.override_generation_config: dict[str, Any] = dict(override_generation_config or {})
        self._sampling_defaults = SamplingDefaults.from_generation_config(
            self.generation_config, source=source, override=self.override_generation_config
        )

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (``config.json``'s ``vocab_size``), if given."""
        value = self.text_config.get("vocab_size")
        return value if isinstance(value, int) else None

    @property
    def max_position_embeddings(self) -> int | None:
        """``config.json``'s ``max_position_embeddings``, if given."""
        value = self.text_config.get("max_position_embeddings")
        return value if isinstance(value, int) else None

    @property
    def eos_token_ids(self) -> list[int]:
        """The generation config's ``eos_token_id`` as a list (it may be an int or a list)."""
        value = self.generation_config.get("eos_token_id")
        if isinstance(value, int):
            return [value]
        if isinstance(value, list):
            return [v for v in value if isinstance(v, int)]
        return []

    def sampling_defaults(self) -> SamplingDefaults:
        """The sampling defaults vLLM's ``--generation-config`` (``auto`` by default, as
        given to the constructor) and ``--override-generation-config`` produce: see
        `SamplingDefaults`. Checked at construction (``ValueError``)."""
        return self._sampling_defaults

    def load_tokenizer(self) -> Tokenizer:
        """The directory's tokenizer (see `Tokenizer`)."""
        return Tokenizer.from_model_files(self)


class Tokenizer:
    """A tokenizer with the surface vLLM's frontend uses (encode, decode, special tokens).

    Backed by a ``tokenizers.Tokenizer`` (``is_fast``; then `backend` is it and the
    detokenizer uses ``DecodeStream``) or, for directories without ``tokenizer.json``, by a
    ``transformers`` tokenizer (the slow detokenization path). Methods never do I/O.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer | None = None,
        *,
        hf_tokenizer: object = None,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        model_vocab_size: int | None = None,
    ) -> None:
        if (backend is None) == (hf_tokenizer is None):
            raise TypeError("give exactly one of backend and hf_tokenizer")
        self.backend = backend
        self._hf: Any = cast("Any", hf_tokenizer)
        self.chat_template = chat_template
        self._clean_up = clean_up_tokenization_spaces
        hf: Any = self._hf
        named = dict(special_tokens or {})
        if hf_tokenizer is not None:
            named = {
                k: v
                for k, v in hf.special_tokens_map.items()
                if k in _NAMED_SPECIAL and isinstance(v, str)
            } | named
            extra_special_tokens = [
                *extra_special_tokens,
                *(t for t in hf.all_special_tokens if t not in named.values()),
            ]
        #: The named special tokens (``bos_token``, ``eos_token``, ...) as strings; a chat
        #: template sees them as globals.
        self.special_tokens_map: dict[str, str] = named
        all_special: list[str] = []
        for tok in [*named.values(), *extra_special_tokens]:
            if tok not in all_special:
                all_special.append(tok)
        self.all_special_tokens: list[str] = all_special
        ids = [self.token_to_id(t) for t in all_special]
        self.all_special_ids: list[int] = [i for i in ids if i is not None]
        self.eos_token_id: int | None = self._named_id("eos_token")
        self.bos_token_id: int | None = self._named_id("bos_token")
        if backend is not None:
            vocab = backend.get_vocab(with_added_tokens=True)
            self._len = len(vocab)
            self.max_token_id: int = max(vocab.values(), default=-1)
            self.added_tokens_decoder: dict[int, str] = {
                i: tok.content for i, tok in backend.get_added_tokens_decoder().items()
            }
            self._is_bpe = type(backend.model).__name__ == "BPE"
            self._space_marker = _metaspace_marker(backend)
        else:
            vocab = hf.get_vocab()
            self._len = len(hf)
            self.max_token_id = max(vocab.values(), default=-1)
            self.added_tokens_decoder = {
                i: str(tok) for i, tok in getattr(hf, "added_tokens_decoder", {}).items()
            }
            self._is_bpe = False
            self._space_marker = None
        #: ``config.json``'s ``vocab_size`` (may exceed the tokenizer's: Qwen pads it). An
        #: id is in vocabulary up to ``max(max_token_id, model_vocab_size - 1)``, as vLLM
        #: validates prompts (``InputProcessor`` does that).
        self.model_vocab_size = model_vocab_size
        self._special_id_set = frozenset(self.all_special_ids)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_model_files(cls, files: ModelFiles) -> Tokenizer:
        """Load the tokenizer of a `ModelFiles` (``tokenizer.json`` preferred)."""
        cfg = files.tokenizer_config
        chat_template = _chat_template(files)
        path = files.path / "tokenizer.json"
        if not path.is_file():
            return cls._from_transformers(files, chat_template)
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        backend = HFTokenizer.from_file(str(path))
        named = {k: c for k in _NAMED_SPECIAL if (c := _token_content(cfg.get(k))) is not None}
        extra: list[str] = []
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = cfg.get(key)
            values = value.values() if isinstance(value, Mapping) else value
            if isinstance(values, Iterable) and not isinstance(values, str):
                extra.extend(c for v in values if (c := _token_content(v)) is not None)
        # What transformers adds on load: tokenizer_config's added_tokens_decoder and the
        # special tokens that the tokenizer.json vocabulary lacks.
        decoder = cfg.get("added_tokens_decoder")
        if isinstance(decoder, Mapping):
            have = backend.get_added_tokens_decoder()
            entries = [(int(k), v) for k, v in decoder.items() if str(k).isdigit()]
            for index, value in sorted(entries, key=lambda kv: kv[0]):
                content = _token_content(value)
                if content is None or index in have or backend.token_to_id(content) is not None:
                    continue
                special = bool(value.get("special", True)) if isinstance(value, Mapping) else True
                backend.add_tokens([AddedToken(content, special=special, normalized=not special)])
        missing = [t for t in [*named.values(), *extra] if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True) for t in missing])
        if backend.post_processor is None and (
            cfg.get("add_bos_token") or cfg.get("add_eos_token")
        ):
            _set_bos_eos_post_processor(backend, cfg, named)
        return cls(
            backend,
            special_tokens=named,
            extra_special_tokens=extra,
            chat_template=chat_template,
            clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
            model_vocab_size=files.vocab_size,
        )

    @classmethod
    def _from_transformers(cls, files: ModelFiles, chat_template: str | None) -> Tokenizer:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise FileNotFoundError(
                f"{files.path} has no tokenizer.json; loading its tokenizer needs the optional "
                "'transformers' package (pip install transformers sentencepiece)"
            ) from None
        hf = AutoTokenizer.from_pretrained(str(files.path))
        return cls(
            hf_tokenizer=hf,
            chat_template=chat_template or getattr(hf, "chat_template", None),
            model_vocab_size=files.vocab_size,
        )

    # -- the vLLM-facing surface ---------------------------------------------------------

    @property
    def is_fast(self) -> bool:
        """Whether a ``tokenizers.Tokenizer`` backs this (DecodeStream applies)."""
        return self.backend is not None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (``len(tokenizer)``)."""
        return self._len

    def __len__(self) -> int:
        return self._len

    @property
    def max_chars_per_token(self) -> int:
        """The longest vocabulary piece, in characters (vLLM's bound for prompt text)."""
        value = self.__dict__.get("_max_chars")
        if value is None:
            vocab = (
                self.backend.get_vocab(with_added_tokens=True)
                if self.backend is not None
                else self._hf.get_vocab()
            )
            value = self.__dict__["_max_chars"] = max((len(t) for t in vocab), default=1)
        return int(value)

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or ``None``."""
        if self.backend is not None:
            return self.backend.token_to_id(token)
        value = self._hf.get_vocab().get(token)
        return value if isinstance(value, int) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS as the post-processor
        (or ``add_bos_token``) says."""
        if self.backend is not None:
            return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (transformers' ``decode``: ``clean_up_tokenization_spaces`` is
        honoured except for BPE models, as transformers v5 does)."""
        if self.backend is None:
            return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up and not self._is_bpe:
            text = _clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(
        self, ids: Sequence[int], skip_special_tokens: bool = False
    ) -> list[str | None]:
        """Vocabulary pieces of ``ids`` (``None`` for an id the tokenizer does not know)."""
        if self.backend is None:
            out = self._hf.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens)
            return list(out)
        id_to_token = self.backend.id_to_token
        skip = self._special_id_set if skip_special_tokens else frozenset()
        return [id_to_token(int(i)) for i in ids if i not in skip]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Join vocabulary pieces into text with the tokenizer's decoder."""
        if self.backend is None:
            return str(self._hf.convert_tokens_to_string(list(tokens)))
        decoder = self.backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def added_vocab(self) -> dict[str, int]:
        """The tokens added to the base vocabulary, piece -> id (``{}`` when a
        ``tokenizers.Tokenizer`` backs this: its pieces join without special handling)."""
        if self.backend is not None:
            return {}
        return dict(self._hf.get_added_vocab())

    @property
    def joins_pieces_plainly(self) -> bool:
        """Whether `convert_tokens_to_string` of any run of pieces is the text: a fast
        tokenizer, or a slow one without added tokens (otherwise vLLM decodes the added
        tokens apart, ``_convert_tokens_to_string_with_added_encoders``)."""
        return self.is_fast or bool(getattr(self._hf, "is_fast", False)) or not self.added_vocab()

    def decode_tokens_individually(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own, as vLLM's ``convert_ids_list_to_tokens`` does for
        logprobs: ``decode([id])``, with the leading spaces a Metaspace decoder strips
        put back."""
        decode = self.decode
        marker = self._space_marker
        if marker is None:
            return [decode([i], skip_special_tokens=False) or "" for i in ids]
        raw = self.convert_ids_to_tokens(ids)
        out: list[str] = []
        for i, piece in zip(ids, raw, strict=True):
            text = decode([i], skip_special_tokens=False) or ""
            out.append(_restore_leading_spaces(piece or "", text, marker))
        return out


def load_tokenizer(model: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model directory or cached hub name."""
    return ModelFiles(model).load_tokenizer()


def _chat_template(files: ModelFiles) -> str | None:
    """The chat template: ``chat_template.jinja``, ``chat_template.json`` or the
    ``chat_template`` of tokenizer_config.json (a string, or a list of named templates of
    which ``default`` is taken), in transformers' order of precedence."""
    jinja = files.path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = _read_json(files.path / "chat_template.json").get("chat_template")
    value = as_json if as_json is not None else files.tokenizer_config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, Mapping)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _set_bos_eos_post_processor(
    backend: tokenizers.Tokenizer, cfg: Mapping[str, Any], named: Mapping[str, str]
) -> None:
    """transformers' ``update_post_processor``: BOS/EOS around every sequence."""
    from tokenizers.processors import TemplateProcessing

    bos = named.get("bos_token") if cfg.get("add_bos_token") else None
    eos = named.get("eos_token") if cfg.get("add_eos_token") else None
    specials = [
        (t, i) for t in (bos, eos) if t is not None and (i := backend.token_to_id(t)) is not None
    ]
    if not specials:
        return
    b = f"{bos}:0 " if bos else ""
    e = f" {eos}:0" if eos else ""
    b1 = f" {bos}:1" if bos else ""
    e1 = f" {eos}:1" if eos else ""
    backend.post_processor = TemplateProcessing(
        single=f"{b}$A:0{e}", pair=f"{b}$A:0{e}{b1} $B:1{e1}", special_tokens=specials
    )


def _metaspace_marker(backend: tokenizers.Tokenizer) -> str | None:
    """vLLM's ``get_leading_space_marker``: the Metaspace replacement character, if any."""
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return None
    if pre.get("type") == "Metaspace":
        return str(pre.get("replacement", "▁"))
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return str(sub.get("replacement", "▁"))
    return None


def _restore_leading_spaces(raw_token: str, token_str: str, marker: str) -> str:
    num_markers = len(raw_token) - len(raw_token.lstrip(marker))
    if num_markers == 0:
        return token_str
    missing = num_markers - (len(token_str) - len(token_str.lstrip(" ")))
    return " " * missing + token_str if missing > 0 else token_str


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )
