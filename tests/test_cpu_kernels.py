"""Our CPU kernels (kernels/cpu_gemv.c through backends/cpu_kernels.py): the products of a decode
step's few float32 rows by a float32 weight, and of one row by a grouped 8-bit or 4-bit QuantWeight,
against torch's product of the same (dequantized) matrix, in every shape the kernels split
differently (rows of w past the last whole tile, inputs past the last whole vector, groups of 16 to
a whole row, with and without offsets); what they refuse falls back to the backend's other paths; and
a machine without a compiler still runs, on those paths. Skipped where this machine cannot build
them (no C compiler)."""

from __future__ import annotations

import pytest
import torch

from pagedcli.backends import cpu_kernels
from pagedcli.model.quant import QuantWeight, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason=f"no CPU kernels: {cpu_kernels.unavailable()}")


def close(got, want):
    """Equal up to the order of float32 additions (a sum of K products of size ~|x||w|)."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n, k", [(960, 576), (13, 1536), (9, 40), (1, 16), (4101, 33)])
def test_float32_rows_are_torchs_product(rows, n, k):
    """N not a multiple of the tile's 8 (or 4) rows of w, K not a multiple of 16, 5 to 8 rows of x
    (a tile of 4 and the rest): the tails are computed too, none twice; a bias is added once."""
    torch.manual_seed(rows * n + k)
    x, w, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    close(cpu_kernels.gemv(x, w), x @ w.T)
    close(cpu_kernels.gemv(x, w, bias), x @ w.T + bias)


def grouped(bits: int, n: int, k: int, group: int, offsets: bool) -> QuantWeight:
    values = (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) if bits == 4
              else torch.randint(-128, 128, (n, k), dtype=torch.int8))
    scale = torch.rand(n, k // group) * 0.02 + 1e-3
    return QuantWeight(values, scale, torch.randn(n, k // group) * 0.05 if offsets else None, bits, group, "test")


@pytest.mark.parametrize("offsets", [False, True], ids=["symmetric", "offsets"])
@pytest.mark.parametrize("bits, n, k, group", [(8, 962, 576, 32), (8, 7, 64, 16), (8, 130, 1536, 1536),
                                               (4, 962, 576, 32), (4, 61, 1536, 128), (4, 3, 256, 256)])
def test_one_row_by_grouped_values_is_the_dequantized_product(bits, n, k, group, offsets):
    """Q8_0-like (8-bit, groups of 32, no offset), Q6_K's groups of 16, int8's one group a row, Q4_1-
    and int4-like (4-bit with a minimum a group): a nibble read as the wrong column, a group's scale
    or offset taken from the next group, or rows past the last 4 left out would show."""
    torch.manual_seed(n + k + group)
    w = grouped(bits, n, k, group, offsets)
    x = torch.randn(1, k)
    close(cpu_kernels.gemv(x, w), x @ w.dequantize().T)


def test_what_the_kernels_do_not_take_is_left_to_the_caller():
    """More rows than MAX_ROWS, more than one row by a QuantWeight, other dtypes, groups the
    vectors do not divide, a weight that is not contiguous: None, and the backend's own path runs."""
    w = torch.randn(8, 64)
    assert cpu_kernels.gemv(torch.randn(cpu_kernels.MAX_ROWS + 1, 64), w) is None
    assert cpu_kernels.gemv(torch.randn(2, 64), quantize_int4(w, 32)) is None
    assert cpu_kernels.gemv(torch.randn(1, 64, dtype=torch.bfloat16), w.bfloat16()) is None
    assert cpu_kernels.gemv(torch.randn(1, 64), torch.randn(64, 8).T) is None
    assert cpu_kernels.gemv(torch.randn(1, 24), QuantWeight(torch.zeros(8, 24, dtype=torch.int8),
                                                            torch.ones(8, 3), None, 8, 8, "test")) is None


def test_inputs_that_do_not_fit_the_weight_are_left_to_torchs_error():
    """x's width must be the weight's: the kernels read K values of x whatever its width, so a
    mismatch is declined here (and torch's product then names it), never a read past x."""
    w = torch.randn(8, 64)
    assert cpu_kernels.gemv(torch.randn(1, 32), w) is None
    assert cpu_kernels.gemv(torch.randn(1, 32), quantize_int8(w)) is None
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.nn.functional.linear(torch.randn(1, 32), w)


def test_a_row_far_wider_than_any_model_is_computed_not_a_crash():
    """The grouped kernels' scratch (group sums, x's columns split) is on the heap: a row of 4M
    inputs (16 MB of it) gives the product, where a stack buffer would have crashed the process."""
    k = 1 << 22
    w = QuantWeight(torch.randint(0, 256, (1, k // 2), dtype=torch.uint8), torch.full((1, k // 32), 1e-3), None, 4,
                    32, "test")
    x = torch.randn(1, k)
    close(cpu_kernels.gemv(x, w), x @ w.dequantize().T)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernels built (or not) afresh under this test's settings, into an empty cache folder
    (tmp_path); what this process had built before is what it has again after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def forget():
        cpu_kernels._built.cache_clear()
        cpu_kernels.grouped.cache_clear()

    forget()
    yield tmp_path
    forget()


def test_a_kernel_folder_other_users_may_write_is_not_loaded_from(fresh_build):
    """A library in the cache runs as this process: where the folder is group- or world-writable,
    the kernels are not loaded (a reason says so) rather than running what another user put there."""
    folder = fresh_build / "pagedcli" / "cpu-kernels"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    assert cpu_kernels.library() is None
    assert "other users" in cpu_kernels.unavailable()


def test_real_int4_and_int8_weights_through_the_backend_are_their_dequantized_products():
    """`quantization` int4 and int8 as the loader makes them (gpt-fast's rounding), at one row."""
    torch.manual_seed(0)
    w, x = torch.randn(200, 512) * 0.02, torch.randn(1, 512)
    for q in (quantize_int4(w, 128), quantize_int8(w)):
        close(cpu_kernels.gemv(x, q), x @ q.dequantize().T)


def test_without_a_compiler_the_backend_keeps_its_other_paths(fresh_build, monkeypatch):
    """No C compiler (CC names a missing program; a fresh cache folder): no library, a reason for the
    notice, and `gemv` declines, so the backend multiplies as before."""
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    assert cpu_kernels.library() is None
    assert "could not be built" in cpu_kernels.unavailable()
    assert cpu_kernels.gemv(torch.randn(1, 64), torch.randn(8, 64)) is None
