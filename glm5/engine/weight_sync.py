"""Weight sync from the trainer to the rollout engines: only changed tensors, as deltas, each
with a checksum of the result; receivers verify everything before changing anything.

Trainer side, a `WeightPublisher` keeps a CPU snapshot of the last published state (every
``model.state_dict()`` tensor, buffers included) and a version (0 = the initial weights).
``publish()`` compares the live state with the snapshot byte for byte and encodes only the
tensors whose bytes changed:

- ``"xor"``: the payload is ``bits(new) ^ bits(old)`` (the tensor viewed as the integer dtype of
  its width), exact for every dtype;
- ``"sub"``: the payload is ``new - old`` in the tensor's dtype, kept only where
  ``old + payload`` gives ``new`` bit for bit (checked when encoding); a tensor where rounding
  defeats it (or a non-floating one) is sent as xor, and the update records each tensor's
  encoding;
- ``"full"`` (`WeightPublisher.full_update`): every tensor's bits, for a fresh or lagging engine.

Engine side, a `WeightReceiver` applies an update to its model only if the update starts from
the version it holds (a full update from any), computes every new tensor into temporaries, checks
each against the sha256 of the trainer's tensor, and only when all match copies them into the
parameters and buffers in place. Any failure leaves the model and the version as they were.

`WeightUpdate.to_bytes` / `from_bytes` is the wire format over HTTP and Ray: safetensors with
the update's JSON header in the safetensors metadata.

The engine layer holds this (an engine server applies updates); the RL loop
(`glm5.rl.weight_sync`) publishes them and adds the staleness rule.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import torch
from torch import nn

__all__ = [
    "WeightSyncError", "StaleUpdateError", "ChecksumMismatchError", "WeightUpdate",
    "WeightPublisher", "WeightReceiver", "apply_to_engine", "tensor_checksum",
    "state_checksums", "weights_equal", "row_checksums", "checksum_matches", "check_update",
]

FORMAT = "glm5-weight-update"
FORMAT_VERSION = 1
_META_KEY = "glm5_weight_update"
PUBLISH_MODES = ("xor", "sub")
UPDATE_MODES = ("xor", "sub", "full")

# The integer dtype an element's bits are viewed as, by element width in bytes (a 16-byte
# complex128 element is viewed as two int64s).
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


class WeightSyncError(ValueError):
    """A weight update cannot be made or applied (the message names the tensor / versions)."""


class StaleUpdateError(WeightSyncError):
    """A delta update does not start from the version the receiver holds."""


class ChecksumMismatchError(WeightSyncError):
    """A tensor computed from an update differs from the trainer's (its checksum)."""


# ---------------------------------------------------------------------------- tensor helpers
def flat_cpu(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D CPU tensor with t's elements (a copy unless t already is one)."""
    return t.detach().to("cpu").contiguous().reshape(-1)


def _int_dtype(dtype: torch.dtype, where: str) -> torch.dtype:
    width = torch.empty((), dtype=dtype).element_size()
    if width not in _INT_OF_WIDTH:  # pragma: no cover - no such dtype among torch's today
        raise WeightSyncError(f"glm5 weight sync: {where} has dtype {dtype} of {width} bytes per "
                              f"element; expected 1, 2, 4, 8 or 16")
    return _INT_OF_WIDTH[width]


def tensor_bits(flat: torch.Tensor, where: str = "a tensor") -> torch.Tensor:
    """The bits of a contiguous 1-D tensor as a 1-D integer tensor (a view, no copy)."""
    return flat.view(_int_dtype(flat.dtype, where))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two contiguous 1-D tensors of one dtype (NaN == NaN of the same bits,
    -0.0 != +0.0: what a checksum sees)."""
    return torch.equal(tensor_bits(a), tensor_bits(b))


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 hex of a tensor's bytes in row-major order (on any device; dtype and shape are
    not hashed, only the bytes)."""
    flat = flat_cpu(t)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


Checksum = Union[str, list]  # a sha256 hex, or [[start_row, stop_row, sha256 hex], ...]


def row_checksums(t: torch.Tensor, bounds: Sequence[int]) -> list[list]:
    """Checksums of row ranges of ``t`` (dim 0; a 0-d tensor has one row): ``bounds`` the
    ascending row boundaries ``[0, b1, ..., rows]``; returns ``[[b0, b1, sha], ...]``. What a
    trainer whose ranks each hold a row shard (FSDP's ``Shard(0)``) can compute without
    gathering the tensor."""
    rows = t.reshape(1, -1) if t.dim() == 0 else t
    return [[int(a), int(b), tensor_checksum(rows[a:b])] for a, b in zip(bounds, bounds[1:])]


def _check_checksum_form(name: str, c: Any, shape: tuple[int, ...]) -> None:
    if isinstance(c, str):
        return
    rows = shape[0] if shape else 1
    ok = isinstance(c, list) and len(c) > 0
    at = 0
    for r in c if ok else ():
        if not (isinstance(r, (list, tuple)) and len(r) == 3 and isinstance(r[2], str)
                and r[0] == at and isinstance(r[1], int) and r[1] >= r[0]):
            ok = False
            break
        at = r[1]
    if not ok or at != rows:
        raise WeightSyncError(f"glm5 WeightUpdate: checksums[{name!r}] expected a sha256 hex or "
                              f"[start_row, stop_row, sha256] ranges covering rows 0..{rows} in "
                              f"order, got {str(c)[:120]}")


def checksum_matches(c: Checksum, new: torch.Tensor, shape: Sequence[int]) -> str | None:
    """None when tensor ``new`` (any layout, reshaped to ``shape``) has checksum ``c`` (whole,
    or row ranges); otherwise a description of the first mismatch."""
    if isinstance(c, str):
        got = tensor_checksum(new)
        return None if got == c else f"sha256 {got[:16]}..., the trainer's is {c[:16]}..."
    t = new.reshape(tuple(shape))
    for (a, b, want), (_, _, got) in zip(c, row_checksums(t, [c[0][0]] + [r[1] for r in c])):
        if got != want:
            return (f"rows {a}:{b} sha256 {got[:16]}..., the trainer's are {want[:16]}...")
    return None


def state_checksums(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{state_dict name: tensor_checksum} of a module's state_dict (or of a name -> tensor
    mapping)."""
    sd = model.state_dict() if isinstance(model, nn.Module) else model
    return {name: tensor_checksum(t) for name, t in sd.items()}


_WeightsLike = Union[nn.Module, Mapping[str, torch.Tensor], Mapping[str, str]]


def _as_state(x: _WeightsLike, where: str) -> dict[str, Any]:
    if isinstance(x, nn.Module):
        return dict(x.state_dict())
    if isinstance(x, Mapping):
        if all(isinstance(v, (torch.Tensor, str)) for v in x.values()):
            return dict(x)
    raise TypeError(f"glm5 weights_equal: {where} expected an nn.Module, a name -> tensor "
                    f"mapping or a name -> checksum mapping (state_checksums), got "
                    f"{type(x).__name__}")


def weights_equal(a: _WeightsLike, b: _WeightsLike) -> bool:
    """True when two models hold the same tensors bit for bit under the same names.

    Each side is a module, a state dict, or a checksum dict (`state_checksums`, e.g. what a
    remote engine's `WeightReceiver.checksums` reports). Two tensors are compared by dtype,
    shape and bits; where one side is a checksum, by checksum.
    """
    sa, sb = _as_state(a, "a"), _as_state(b, "b")
    if sa.keys() != sb.keys():
        return False
    for name, x in sa.items():
        y = sb[name]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not same_bits(flat_cpu(x),
                                                                          flat_cpu(y)):
                return False
        else:
            cx = x if isinstance(x, str) else tensor_checksum(x)
            cy = y if isinstance(y, str) else tensor_checksum(y)
            if cx != cy:
                return False
    return True


# ---------------------------------------------------------------------------- the update
def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _dtype_of(name: Any, where: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: {where} expected a torch dtype "
                              f"name, got {name!r}")
    return d


@dataclass(eq=False)
class WeightUpdate:
    """The tensors that changed between two weight versions.

    tensors[name]: the payload, a 1-D tensor — ``"xor"`` / ``"full"``: the bits (XOR of new
    and old, or new) as the integer dtype of the element width (uint8 / int16 / int32 / int64);
    ``"sub"``: new - old in the tensor's dtype. modes[name]: that tensor's encoding (an update of
    mode ``"sub"`` holds ``"xor"`` tensors where subtraction was not exact). shapes / dtypes:
    the tensor as the model holds it; checksums[name]: sha256 hex of the trainer's tensor (the
    result of applying), see `tensor_checksum`.
    """

    base_version: int
    version: int
    mode: str
    tensors: dict[str, torch.Tensor]
    checksums: dict[str, Checksum]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    modes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in UPDATE_MODES:
            raise WeightSyncError(f"glm5 WeightUpdate: mode expected one of {list(UPDATE_MODES)}"
                                  f", got {self.mode!r}")
        for k in ("base_version", "version"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int):
                raise WeightSyncError(f"glm5 WeightUpdate: {k} expected an int, got {v!r}")
        if not self.modes:
            self.modes = {name: self.mode for name in self.tensors}
        names = set(self.tensors)
        for k in ("checksums", "shapes", "dtypes", "modes"):
            other = set(getattr(self, k))
            if other != names:
                odd = sorted(names ^ other)[0]
                raise WeightSyncError(f"glm5 WeightUpdate: tensors and {k} expected the same "
                                      f"names; {odd!r} is in only one")
        self.shapes = {n: tuple(int(x) for x in s) for n, s in self.shapes.items()}
        for n, c in self.checksums.items():
            _check_checksum_form(n, c, self.shapes[n])

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    @property
    def nbytes(self) -> int:
        """Bytes of the payload tensors (what the deltas cost on the wire, headers aside)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        """safetensors bytes: the payload tensors, and the rest as JSON in the metadata."""
        from safetensors.torch import save

        header = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "base_version": self.base_version, "version": self.version, "mode": self.mode,
            "modes": self.modes, "checksums": self.checksums,
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "dtypes": {n: _dtype_name(d) for n, d in self.dtypes.items()},
        }
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in self.tensors.items()}
        return save(tensors, metadata={_META_KEY: json.dumps(header, sort_keys=True)})

    @classmethod
    def from_bytes(cls, b: bytes) -> "WeightUpdate":
        """The update `to_bytes` wrote (raises WeightSyncError on anything else)."""
        from safetensors.torch import load

        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: b expected bytes, got "
                                  f"{type(b).__name__}")
        b = bytes(b)
        try:
            tensors = load(b)
            meta = _safetensors_metadata(b)
        except Exception as e:  # noqa: BLE001 - any parse failure is the same bad input
            raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: not a safetensors weight "
                                  f"update ({type(e).__name__}: {e})") from e
        raw = (meta or {}).get(_META_KEY)
        if raw is None:
            raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: the safetensors metadata has "
                                  f"no {_META_KEY!r} header (not a weight update)")
        try:
            h = json.loads(raw)
        except json.JSONDecodeError as e:
            raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: the {_META_KEY!r} header is "
                                  f"not JSON ({e})") from e
        got = (h.get("format"), h.get("format_version")) if isinstance(h, dict) else (h, None)
        if got != (FORMAT, FORMAT_VERSION):
            raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: expected format {FORMAT!r} "
                                  f"version {FORMAT_VERSION}, got {got[0]!r} version {got[1]!r}")
        try:
            return cls(base_version=h["base_version"], version=h["version"], mode=h["mode"],
                       tensors=tensors, checksums=dict(h["checksums"]),
                       shapes={n: tuple(s) for n, s in h["shapes"].items()},
                       dtypes={n: _dtype_of(d, f"dtypes[{n!r}]") for n, d in h["dtypes"].items()},
                       modes=dict(h["modes"]))
        except KeyError as e:
            raise WeightSyncError(f"glm5 WeightUpdate.from_bytes: the header lacks {e}") from e


def _safetensors_metadata(b: bytes) -> dict[str, str] | None:
    """The ``__metadata__`` of safetensors bytes (8-byte little-endian header length, then the
    JSON header)."""
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8:8 + n])
    return header.get("__metadata__") if isinstance(header, dict) else None


# ---------------------------------------------------------------------------- trainer side
def encode_sub(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """``new - old`` when ``old + (new - old)`` gives ``new`` bit for bit, else None.

    The subtraction is exact when old and new are within a factor 2 of each other (Sterbenz),
    the usual case after a small optimizer step. Where it is not (a sign change, a weight that
    shrank by half, NaN / inf), no correction of the payload helps in general: a weight near
    zero next to a large old value needs a finer step than the payload's dtype has near
    ``new - old`` (measured: correcting by the residual or by one ulp recovered none of the
    failing elements), so the caller sends that tensor as xor.
    """
    d = new - old
    return d if same_bits(old + d, new) else None


class WeightPublisher:
    """The trainer's side: versions of ``model``'s weights and the updates between them.

    Holds a CPU copy of the last published ``model.state_dict()`` (one model's worth of host
    memory). ``version`` 0 is the weights at construction.
    """

    def __init__(self, model: nn.Module, mode: str = "xor") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"glm5 WeightPublisher: model expected an nn.Module, got "
                            f"{type(model).__name__}")
        if mode not in PUBLISH_MODES:
            raise WeightSyncError(f"glm5 WeightPublisher: mode expected one of "
                                  f"{list(PUBLISH_MODES)}, got {mode!r}")
        self.model, self.mode = model, mode
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._snap: dict[str, torch.Tensor] = {}  # flat CPU copies
        for name, t in model.state_dict().items():
            self._shapes[name] = tuple(t.shape)
            self._snap[name] = flat_cpu(t).clone()
        self._sums = {n: tensor_checksum(t) for n, t in self._snap.items()}
        self._version = 0

    @property
    def version(self) -> int:
        """The version of the last published state (0: the weights at construction)."""
        return self._version

    def checksums(self) -> dict[str, str]:
        """Checksums of the published state (what a synced receiver's `checksums` equals)."""
        return dict(self._sums)

    def full_update(self) -> WeightUpdate:
        """Every tensor of the state at `version` (not the live model's unpublished changes),
        mode ``"full"``: brings a fresh or lagging receiver to `version` whatever it held."""
        tensors = {n: tensor_bits(t, n).clone() for n, t in self._snap.items()}
        return WeightUpdate(base_version=self._version, version=self._version, mode="full",
                            tensors=tensors, checksums=dict(self._sums),
                            shapes=dict(self._shapes),
                            dtypes={n: t.dtype for n, t in self._snap.items()},
                            modes={n: "full" for n in self._snap})

    def publish(self) -> WeightUpdate | None:
        """The update from `version` to the live state, or None (version unchanged) when no
        tensor's bytes changed. Moves `version` on by one and the snapshot to the live state."""
        live = self.model.state_dict()
        if live.keys() != self._snap.keys():
            extra = sorted(set(live) - set(self._snap))
            gone = sorted(set(self._snap) - set(live))
            raise WeightSyncError(f"glm5 WeightPublisher.publish: the model's state_dict names "
                                  f"changed since version 0 (new: {extra[:3]}, missing: "
                                  f"{gone[:3]})")
        tensors, modes, sums, dtypes, shapes, new_snap = {}, {}, {}, {}, {}, {}
        for name, t in live.items():
            old = self._snap[name]
            if tuple(t.shape) != self._shapes[name] or t.dtype != old.dtype:
                raise WeightSyncError(f"glm5 WeightPublisher.publish: tensor {name!r} changed "
                                      f"from {self._shapes[name]} {old.dtype} to "
                                      f"{tuple(t.shape)} {t.dtype}; a weight update keeps shapes "
                                      f"and dtypes")
            new = flat_cpu(t)
            if new.data_ptr() == t.data_ptr():
                new = new.clone()  # a view of the live parameter: the snapshot must not move
            if same_bits(new, old):
                continue
            payload = None
            if self.mode == "sub" and new.is_floating_point():
                payload = encode_sub(old, new)
            if payload is not None:
                modes[name] = "sub"
            else:
                payload, modes[name] = tensor_bits(new, name) ^ tensor_bits(old, name), "xor"
            tensors[name], sums[name] = payload, tensor_checksum(new)
            dtypes[name], shapes[name], new_snap[name] = new.dtype, self._shapes[name], new
        if not tensors:
            return None
        update = WeightUpdate(base_version=self._version, version=self._version + 1,
                              mode=self.mode, tensors=tensors, checksums=sums, shapes=shapes,
                              dtypes=dtypes, modes=modes)
        self._snap.update(new_snap)
        self._sums.update(sums)
        self._version += 1
        return update

    def state_dict(self) -> dict[str, Any]:
        """The published snapshot and its version (a checkpoint: a resumed run's workers are
        built from `full_update`, i.e. the weights they held, not the trainer's newer ones)."""
        return {"version": self._version, "snapshot": {n: t.clone() for n, t in
                                                        self._snap.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        snap = state["snapshot"]
        if snap.keys() != self._snap.keys():
            raise WeightSyncError("glm5 WeightPublisher.load_state_dict: the snapshot's tensor "
                                  "names differ from this model's")
        for n, t in snap.items():
            if t.dtype != self._snap[n].dtype or t.numel() != self._snap[n].numel():
                raise WeightSyncError(f"glm5 WeightPublisher.load_state_dict: tensor {n!r} is "
                                      f"{t.dtype} x {t.numel()}, expected "
                                      f"{self._snap[n].dtype} x {self._snap[n].numel()}")
        self._snap = {n: t.clone() for n, t in snap.items()}
        self._sums = {n: tensor_checksum(t) for n, t in self._snap.items()}
        self._version = int(state["version"])


# ---------------------------------------------------------------------------- engine side
def check_update(update: WeightUpdate, held: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 version: int, who: str, holder: str) -> None:
    """Every structural check of ``update`` against the tensors a receiver holds (``held``:
    name -> (whole shape, dtype)) at ``version``, before any arithmetic: the base version
    (`StaleUpdateError`), a full update naming every tensor, names, shapes, dtypes, encodings
    and payload sizes (`WeightSyncError`). ``who`` / ``holder`` name the caller in errors."""
    if update.mode != "full" and update.base_version != version:
        raise StaleUpdateError(
            f"{who}: the update goes from version {update.base_version} to {update.version}, "
            f"{holder} holds version {version} (apply the updates in order, or a full update)")
    if update.mode == "full":
        missing = sorted(set(held) - set(update.tensors))
        if missing:
            raise WeightSyncError(f"{who}: a full update lacks tensor {missing[0]!r} (and "
                                  f"{len(missing) - 1} more) of the model")
    allowed = {"xor": ("xor",), "sub": ("sub", "xor"), "full": ("full",)}[update.mode]
    for name, payload in update.tensors.items():
        if name not in held:
            raise WeightSyncError(f"{who}: tensor {name!r} of the update is not in the model's "
                                  f"state_dict")
        (have_shape, have_dtype), shape, dtype = held[name], update.shapes[name], \
            update.dtypes[name]
        if tuple(have_shape) != shape or have_dtype != dtype:
            raise WeightSyncError(f"{who}: tensor {name!r} is {tuple(have_shape)} {have_dtype} in "
                                  f"the model, the update has {shape} {dtype}")
        mode = update.modes[name]
        if mode not in allowed:
            raise WeightSyncError(f"{who}: tensor {name!r} has encoding {mode!r}; an update of "
                                  f"mode {update.mode!r} allows {list(allowed)}")
        numel = torch.Size(shape).numel()
        if mode == "sub":
            want_dtype, want_n = dtype, numel
            if not dtype.is_floating_point:
                raise WeightSyncError(f"{who}: tensor {name!r} is {dtype}; a 'sub' encoding "
                                      f"needs a floating dtype")
        else:
            want_dtype = _int_dtype(dtype, name)
            want_n = numel * torch.empty((), dtype=dtype).element_size() // torch.empty(
                (), dtype=want_dtype).element_size()
        if payload.dtype != want_dtype or payload.dim() != 1 or payload.numel() != want_n:
            raise WeightSyncError(f"{who}: tensor {name!r}: the {mode!r} payload expected "
                                  f"{want_n} elements of {want_dtype} (1-D), got "
                                  f"{tuple(payload.shape)} {payload.dtype}")


class WeightReceiver:
    """The rollout engine's side: applies `WeightUpdate`s to ``model`` atomically.

    ``version``: the version ``model`` holds now (0: the same initial weights as the trainer's
    publisher; a receiver that starts elsewhere applies a full update first).
    """

    def __init__(self, model: nn.Module, version: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"glm5 WeightReceiver: model expected an nn.Module, got "
                            f"{type(model).__name__}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"glm5 WeightReceiver: version expected an int, got {version!r}")
        self.model = model
        self._version = version

    @property
    def version(self) -> int:
        return self._version

    def checksums(self) -> dict[str, str]:
        """`state_checksums` of the model as it is now."""
        return state_checksums(self.model)

    def _check(self, update: WeightUpdate, live: dict[str, torch.Tensor]) -> None:
        if not isinstance(update, WeightUpdate):
            raise TypeError(f"glm5 WeightReceiver.apply: update expected a WeightUpdate, got "
                            f"{type(update).__name__}")
        check_update(update, {n: (tuple(t.shape), t.dtype) for n, t in live.items()},
                     self._version, "glm5 WeightReceiver.apply", "this receiver")

    def apply(self, update: WeightUpdate) -> int:
        """Apply ``update`` to the model; returns the new version.

        Raises `StaleUpdateError` when a delta does not start from `version`,
        `ChecksumMismatchError` when a computed tensor differs from the trainer's, and
        `WeightSyncError` on a tensor the model lacks or holds with another shape / dtype. On
        any error the model's tensors and `version` are left as they were.
        """
        live = self.model.state_dict(keep_vars=True)
        self._check(update, live)
        # Every new tensor into a CPU temporary first (the same arithmetic the publisher checked
        # "sub" with), verified before the model is touched.
        olds: dict[str, torch.Tensor] = {}
        news: dict[str, torch.Tensor] = {}
        for name, payload in update.tensors.items():
            old = flat_cpu(live[name])
            if old.data_ptr() == live[name].data_ptr():
                old = old.clone()  # kept for the rollback: must not alias the parameter
            mode = update.modes[name]
            pay = payload.detach().to("cpu")
            if mode == "full":
                new = pay.view(old.dtype).clone()
            elif mode == "xor":
                new = (tensor_bits(old, name) ^ pay).view(old.dtype)
            else:
                new = old + pay
            bad = checksum_matches(update.checksums[name], new, update.shapes[name])
            if bad is not None:
                raise ChecksumMismatchError(
                    f"glm5 WeightReceiver.apply: tensor {name!r} computed from the update "
                    f"({update.base_version} -> {update.version}, {mode}) has {bad}; nothing "
                    f"was applied (version stays {self._version})")
            olds[name], news[name] = old, new
        tried: list[str] = []
        with torch.no_grad():
            try:
                for name, new in news.items():
                    tried.append(name)  # a copy_ can fail after writing (e.g. an inference
                    live[name].copy_(new.view(update.shapes[name]))  # tensor): undo it too
            except BaseException:
                for name in tried:  # put back everything touched: all or nothing
                    try:
                        live[name].copy_(olds[name].view(update.shapes[name]))
                    except Exception:  # noqa: BLE001 - restore the rest; the first error wins
                        pass
                raise
        self._version = update.version
        return self._version


def apply_to_engine(engine: Any, receiver: WeightReceiver, update: WeightUpdate) -> int:
    """Apply ``update`` to an engine's model through ``receiver`` and tell the engine its new
    version (`LLMEngine.set_weights_version`: new tokens carry it, the prefix cache is emptied).

    ``engine``: an `LLMEngine`, or an `AsyncEngine` (the update then runs between its steps).
    Returns the new version; on error neither the model nor the engine's version changes.
    """
    if hasattr(engine, "between_steps") and hasattr(engine, "engine"):
        return engine.between_steps(lambda e: apply_to_engine(e, receiver, update))
    if not hasattr(engine, "set_weights_version") or not hasattr(engine, "model"):
        raise TypeError(f"glm5 apply_to_engine: engine expected an LLMEngine or AsyncEngine, got "
                        f"{type(engine).__name__}")
    if receiver.model is not engine.model:
        raise WeightSyncError("glm5 apply_to_engine: receiver.model is not engine.model (the "
                              "receiver would update another model than the engine runs)")
    version = receiver.apply(update)
    engine.set_weights_version(version)
    return version


# ---------------------------------------------------------------------------- staleness
