"""The Hub's 4-bit checkpoints, read into QuantWeights (model/quant.py) as vLLM reads them.

config.json's quantization_config names the packing; each linear layer `<name>.weight` is stored
as packed int32 words of 8 four-bit values, float16 scales and 4-bit zero points per group of
`group` inputs of an output row (w = (q - zero) * scale):

  awq (GEMM)            qweight [in, out / 8]: 8 outputs a word, nibble i holding output AWQ_ORDER[i];
                        qzeros [in / group, out / 8] the same way; scales [in / group, out]
  gptq                  qweight [in / 8, out]: 8 consecutive inputs a word, the first in the low nibble;
                        qzeros [in / group, out / 8]: 8 consecutive outputs a word, each the zero
                        minus 1 (gptq v1 checkpoints; checkpoint_format gptq_v2 stores the zero);
                        scales [in / group, out]; g_idx [in] each input's group (act-order, a
                        permuted g_idx, is refused)
  compressed-tensors    weight_packed [out, in / 8]: 8 consecutive inputs a word, the first in the
  pack-quantized        low nibble, each q + 8 of a signed q in -8..7; weight_scale [out, in / group];
                        weight_zero_point [out / 8, in / group] packed along the outputs the same
                        way (asymmetric schemes; symmetric ones have none); weight_shape [2]

Every format comes out as QuantWeight's unsigned q in 0..15 with offset -zero * scale (so
compressed-tensors' signed zero points become unsigned the same way as its values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError

from pagedcli.core.errors import RunError, show_value
from pagedcli.model.quant import QuantWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output AWQ_ORDER[i] of its 8
PACK = 8  # 4-bit values an int32 holds
SCALE_DTYPES = ("F16", "BF16", "F32")
HINT = "pagedcli reads 4-bit AWQ (GEMM), GPTQ and compressed-tensors pack-quantized checkpoints"


@dataclass(frozen=True)
class PackedScheme:
    """How a checkpoint packs its linear layers: `method` awq, gptq or compressed-tensors;
    `zero_minus_one`: gptq v1's stored zeros (zero - 1); `symmetric`: compressed-tensors without zero
    points."""

    method: str
    zero_minus_one: bool = False
    symmetric: bool = False

    def tensor_names(self, name: str) -> dict[str, str]:
        """The packed tensors standing for `<base>.weight`: role -> tensor name."""
        base = name.removesuffix("weight")
        if self.method == "compressed-tensors":
            roles = {"packed": "weight_packed", "scale": "weight_scale", "shape": "weight_shape"}
            if not self.symmetric:
                roles["zeros"] = "weight_zero_point"
        else:
            roles = {"packed": "qweight", "zeros": "qzeros", "scale": "scales"}
        return {role: base + suffix for role, suffix in roles.items()}

    def stores(self, where: dict, name: str) -> bool:
        """Whether the checkpoint holds `name` packed (else it is a float tensor, or missing)."""
        return self.tensor_names(name)["packed"] in where

    def check(self, where: dict, name: str, shape: tuple[int, int]) -> None:
        """The packed tensors' dtypes and shapes against the float weight's [out, in], from the
        headers: before any tensor is read."""
        out, width = shape
        names = self.tensor_names(name)
        missing = [n for n in names.values() if n not in where]
        if missing:
            raise RunError(f"tensor {missing[0]} missing beside {names['packed']}", "download the checkpoint again")
        headers = {role: _header(where, n) for role, n in names.items()}
        groups = _groups(self.method, headers["scale"][1])
        if not groups or width % groups or (width // groups) % 2:
            raise RunError(f"tensor {names['scale']} has shape {list(headers['scale'][1])}: its groups do not "
                           f"divide the layer's {width} inputs", "download the checkpoint again")
        expect = {"packed": ("I32", _packed_shape(self.method, out, width)),
                  "scale": (SCALE_DTYPES, (out, groups) if self.method == "compressed-tensors" else (groups, out))}
        if "zeros" in names:
            zeros = (-(-out // PACK), groups) if self.method == "compressed-tensors" else (groups, out // PACK)
            expect["zeros"] = ("I32", zeros)
        if self.method == "compressed-tensors":
            expect["shape"] = (("I32", "I64"), (2,))
        if self.method != "compressed-tensors" and out % PACK:
            raise RunError(f"tensor {names['packed']}: {out} outputs are not a multiple of {PACK}", HINT)
        for role, (dtypes, want) in expect.items():
            dtype, got = headers[role]
            if dtype not in (dtypes if isinstance(dtypes, tuple) else (dtypes,)) or tuple(got) != want:
                raise RunError(f"tensor {names[role]} is {dtype} {list(got)}, the {self.method} packing of a "
                               f"[{out}, {width}] weight is {_first(dtypes)} {list(want)}", "download the checkpoint again")

    def read(self, where: dict, name: str, shape: tuple[int, int], device) -> QuantWeight:
        """`name`'s packed tensors as a QuantWeight on `device`, exactly the values they pack."""
        out, width = shape
        names = self.tensor_names(name)
        t = {role: _tensor(where, n) for role, n in names.items()}
        scale = t["scale"].float()
        if not torch.isfinite(scale).all():
            raise RunError(f"tensor {names['scale']} holds a scale that is not finite",
                           "the checkpoint is damaged; download it again")
        if self.method == "awq":
            q = _unpack_awq(t["packed"]).T  # [in, out] -> [out, in]
            zeros, scale = _unpack_awq(t["zeros"]).T, scale.T
        elif self.method == "gptq":
            self._check_g_idx(where, name, width, scale.shape[0])
            q = _unpack_rows(t["packed"]).T  # [in, out] -> [out, in]
            zeros, scale = (_unpack_columns(t["zeros"]) + int(self.zero_minus_one)).T, scale.T
        else:
            self._check_g_idx(where, name, width, scale.shape[1], "weight_g_idx")
            if [int(x) for x in t["shape"]] != [out, width]:
                raise RunError(f"tensor {names['shape']} says {t['shape'].tolist()}, config.json implies {[out, width]}")
            q = _unpack_columns(t["packed"])[:, :width]
            # signed values and zero points stored + 8; a symmetric scheme's zero point is 0 (stored 8)
            zeros = torch.full(scale.shape, 8) if self.symmetric else _unpack_rows(t["zeros"])[:out]
        offset = -zeros.float() * scale
        return QuantWeight(pack_int4(q).to(device), scale.contiguous().to(device), offset.contiguous().to(device),
                           4, width // scale.shape[1], self.method)

    def _check_g_idx(self, where: dict, name: str, width: int, groups: int, suffix: str = "g_idx") -> None:
        """A g_idx that is not input i -> group i // group (act-order) is refused: its groups are
        scattered over the inputs, which QuantWeight's consecutive groups cannot hold."""
        g_name = name.removesuffix("weight") + suffix
        if g_name not in where:
            return
        g_idx = _tensor(where, g_name).long()
        if not torch.equal(g_idx, torch.arange(width) // (width // groups)):
            raise RunError(f"tensor {g_name}: the checkpoint is quantized with act-order (desc_act), which pagedcli "
                           "does not read", "use a checkpoint quantized without act-order (desc_act false)")


def packed_scheme(config) -> PackedScheme | None:
    """The packing config.json's quantization_config names, or None for a float or fp8 checkpoint
    (model/weights.py's fp8_checkpoint reads those); any other 4-bit scheme, or another bit width,
    is refused in one line."""
    q = config.raw.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method in ("awq", "gptq"):
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            raise RunError(f"config.json: {method} weights of {show_value(bits)} bits are not supported", HINT)
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise RunError(f"config.json: AWQ version {show_value(q.get('version'))} is not supported",
                               "pagedcli reads AWQ's GEMM packing (version gemm)")
            if q.get("zero_point") is False:
                raise RunError("config.json: AWQ without zero points (zero_point false) is not supported", HINT)
            return PackedScheme("awq")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise RunError(f"config.json: GPTQ checkpoint_format {show_value(fmt)} is not supported",
                           "pagedcli reads checkpoint_format gptq (v1) and gptq_v2")
        return PackedScheme("gptq", zero_minus_one=fmt == "gptq")
    if method != "compressed-tensors":
        return None
    groups = q.get("config_groups")
    schemes = [g.get("weights") if isinstance(g, dict) else None for g in groups.values()] if isinstance(groups, dict) else []
    if not any(isinstance(w, dict) and w.get("type") == "int" for w in schemes):
        return None  # fp8 (float weights): weights.py's fp8 reader, which refuses the rest
    formats = {q.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")}
    formats.discard(None)
    if formats != {"pack-quantized"}:
        raise RunError(f"config.json: compressed-tensors format {show_value(sorted(formats) or None)} is not supported",
                       "pagedcli reads integer weights packed as pack-quantized (W4A16)")
    for w in schemes:
        if not isinstance(w, dict) or w.get("type") != "int" or w.get("num_bits") != 4:
            raise RunError(f"config.json: compressed-tensors weights {show_value(w)} are not supported",
                           "pagedcli reads 4-bit integer weights (W4A16)")
        if w.get("strategy") not in ("group", "channel"):
            raise RunError(f"config.json: compressed-tensors strategy {show_value(w.get('strategy'))} is not supported",
                           "pagedcli reads scales per group or per channel")
        if w.get("dynamic"):
            raise RunError("config.json: compressed-tensors dynamic weight scales are not supported", HINT)
    symmetric = {bool(w.get("symmetric", True)) for w in schemes}
    if len(symmetric) > 1:
        raise RunError("config.json: compressed-tensors groups mix symmetric and asymmetric weights",
                       "pagedcli reads one kind a checkpoint")
    return PackedScheme("compressed-tensors", symmetric=symmetric.pop())


# --- unpacking -----------------------------------------------------------------------------------
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # slot i of a word: bits 4i .. 4i + 3


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> [..., n, 8]: each word's 8 four-bit values, slot 0 (the low bits) first."""
    return (words.to(torch.int32)[..., None] >> SHIFTS) & 0xF


def _unpack_columns(words: torch.Tensor) -> torch.Tensor:
    """[r, c] words of 8 consecutive columns each -> [r, 8c] values."""
    return _nibbles(words).reshape(words.shape[0], -1)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """[r, c] words of 8 consecutive rows each -> [8r, c] values."""
    return _nibbles(words).permute(0, 2, 1).reshape(-1, words.shape[1])


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """[r, c] AWQ words -> [r, 8c] values, output 8j + AWQ_ORDER[i] from slot i of word j."""
    slots = _nibbles(words)
    natural = torch.empty_like(slots)
    natural[..., list(AWQ_ORDER)] = slots
    return natural.reshape(words.shape[0], -1)


def _packed_shape(method: str, out: int, width: int) -> tuple[int, int]:
    return {"awq": (width, out // PACK), "gptq": (width // PACK, out), "compressed-tensors": (out, -(-width // PACK))}[method]


def _groups(method: str, scale_shape) -> int | None:
    if len(scale_shape) != 2:
        return None
    return scale_shape[1] if method == "compressed-tensors" else scale_shape[0]


def _header(where: dict, name: str) -> tuple[str, tuple[int, ...]]:
    try:
        s = where[name].get_slice(name)
        return s.get_dtype(), tuple(s.get_shape())
    except (SafetensorError, OSError, ValueError) as e:
        raise RunError(f"tensor {name} could not be read ({str(e).strip()[:200]})",
                       "the file may be truncated; download it again") from None


def _tensor(where: dict, name: str) -> torch.Tensor:
    try:
        return where[name].get_tensor(name)
    except (SafetensorError, OSError, ValueError) as e:
        raise RunError(f"tensor {name} could not be read ({str(e).strip()[:200]})",
                       "the file may be truncated; download it again") from None


def _first(dtypes) -> str:
    return dtypes[0] if isinstance(dtypes, tuple) else dtypes
