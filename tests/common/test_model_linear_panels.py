"""The panels' matrix products (sssd._kernels.linear_bf16, linear_f32), in each build this CPU
can run (AVX-512, and AVX2 wherever the CPU has it, forced by kernel_paths on an AVX-512 CPU):
bfloat16 gives the same bits as the sums its build specifies, in its order; float32 the product
to rounding; in both a row's result does not depend on the rows beside it."""

import numpy as np
import pytest
import torch

from sssd.common.model import kernel_paths
from sssd.common.model.linear import Linear, pack_panels

PANELS = kernel_paths.chosen()["panels"]
pytestmark = pytest.mark.skipif(PANELS["bfloat16"] == "none",
                                reason="this CPU has neither AVX-512 nor AVX2 and FMA: the "
                                "decoder uses oneDNN or PyTorch's products")
# The builds to test: the CPU's own, and AVX2 forced where the CPU would choose AVX-512.
BUILDS = ["native"] + (["avx2"] if kernel_paths.cpu_features()["avx2_fma"] and "avx512" in
                       PANELS.values() else [])


@pytest.fixture(params=BUILDS)
def build(request):
    """Runs the test with the CPU's own build of the products or the AVX2 one forced; yields
    the build the bfloat16 products then run ("avx512" or "avx2")."""
    forced = {"panels": "avx2"} if request.param == "avx2" else {}
    with kernel_paths.forced(**forced):
        yield kernel_paths.path("panels", torch.bfloat16)


def random_product(rows: int, features: int, outputs: int, with_bias: bool,
                   dtype: torch.dtype = torch.bfloat16):
    """x, weight and bias (or None) of a product, drawn from a generator seeded by `rows`."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, features, generator=generator).to(dtype)
    weight = torch.randn(outputs, features, generator=generator).to(dtype)
    bias = torch.randn(outputs, generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


def specified(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              build: str) -> torch.Tensor:
    """out[m, n] in float32, as the build sums it: for each pair of inputs (2t, 2t + 1) in
    order, the odd product added, then the even one (VDPBF16PS, AVX-512), or the even one, then
    the odd one (two fused multiply-adds, AVX2), each product exact in float32; then the bias;
    rounded to bfloat16 to nearest even."""
    xs, ws = x.float().numpy(), weight.float().numpy()
    sums = np.zeros((x.shape[0], weight.shape[0]), np.float32)
    for t in range(x.shape[1] // 2):
        for k in ((2 * t + 1, 2 * t) if build == "avx512" else (2 * t, 2 * t + 1)):
            sums = sums + np.outer(xs[:, k], ws[:, k]).astype(np.float32)
    if bias is not None:
        sums = sums + bias.float().numpy()
    return torch.from_numpy(sums).bfloat16()


@pytest.mark.parametrize("rows,features,outputs,with_bias", [
    (1, 96, 64, False),   # one row, one full panel
    (7, 1100, 130, True),  # a row tile and a remainder, 9 input blocks (a partial), a padded panel
    (13, 64, 70, True),
])
def test_every_bit_is_the_specified_sum(rows, features, outputs, with_bias, build):
    x, weight, bias = random_product(rows, features, outputs, with_bias)
    got = Linear(weight, bias, "panels")(x)
    assert got.shape == (rows, outputs) and got.dtype == torch.bfloat16
    assert torch.equal(got, specified(x, weight, bias, build))
    # and the same product as PyTorch's, up to bfloat16 rounding of a differently ordered sum
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight, bias).float(),
                               rtol=2e-2, atol=0.5)


@pytest.mark.parametrize("rows,features,outputs,with_bias", [
    (1, 96, 64, False), (7, 2100, 130, True), (13, 64, 70, True)])
def test_float32_is_the_product_to_rounding(rows, features, outputs, with_bias, build):
    x, weight, bias = random_product(rows, features, outputs, with_bias, torch.float32)
    got = Linear(weight, bias, "panels")(x)
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    exact = torch.nn.functional.linear(x.double(), weight.double(),
                                       None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-5 * features ** 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, build):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 1536, generator=generator).to(dtype)
    linear = Linear(weight, None, "panels")
    x = (3 * torch.randn(40, 1536, generator=generator)).to(dtype)
    alone = torch.cat([linear(x[m:m + 1]) for m in range(40)])
    for count in (2, 5, 6, 7, 12, 40):
        assert torch.equal(linear(x[:count]), alone[:count]), count
    assert torch.equal(linear(x.flip(0)), alone.flip(0))


def test_the_packing_puts_each_pair_of_weights_of_a_panel_side_by_side():
    weight = torch.arange(70 * 4).view(70, 4).bfloat16()  # exact small integers
    packed = pack_panels(weight)
    assert packed.shape == (2, 2, 64, 2)
    assert torch.equal(packed[1, 1, 3], weight[64 + 3, 2:4])
    assert torch.equal(packed[1, :, 6:], torch.zeros(2, 58, 2, dtype=torch.bfloat16))
    packed = pack_panels(weight.float())
    assert packed.shape == (2, 4, 64)
    assert torch.equal(packed[1, 2, 3], weight[64 + 3, 2].float())


def test_weights_it_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="even width"):
        Linear(torch.zeros(8, 5, dtype=torch.bfloat16), None, "panels")
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        Linear(torch.zeros(8, 4, dtype=torch.float16), None, "panels")
    with pytest.raises(ValueError, match="layout"):
        Linear(torch.zeros(8, 4), None, "blocked")


amx = pytest.mark.skipif(not kernel_paths.cpu_features()["amx_bf16"],
                         reason="this CPU has no AMX bfloat16 tiles (or the OS does not grant "
                         "them): the decoder uses the AVX-512 panels")


@amx
@pytest.mark.parametrize("rows,features,outputs,with_bias", [
    (1, 64, 64, False),      # one row, one tile of inputs, one panel
    (5, 2112, 130, True),    # two input blocks, a padded panel
    (37, 96, 200, True),     # two full row groups and a padded third
])
def test_amx_is_the_product_to_bfloat16_rounding(rows, features, outputs, with_bias):
    x, weight, bias = random_product(rows, features, outputs, with_bias)
    got = Linear(weight, bias, "amx")(x)
    assert got.shape == (rows, outputs) and got.dtype == torch.bfloat16
    # Each sum in float32, rounded once: within a unit in the last place of the exact result.
    exact = torch.nn.functional.linear(x.double(), weight.double(),
                                       None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -7, atol=1e-3 * features ** 0.5)


@amx
def test_amx_rows_do_not_depend_on_the_rows_beside_them():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 1536, generator=generator).bfloat16()
    linear = Linear(weight, None, "amx")
    x = (3 * torch.randn(40, 1536, generator=generator)).bfloat16()
    alone = torch.cat([linear(x[m:m + 1]) for m in range(40)])
    for count in (2, 5, 15, 16, 17, 33, 40):
        assert torch.equal(linear(x[:count]), alone[:count]), count
    assert torch.equal(linear(x.flip(0)), alone.flip(0))
    # The rows that pad a short group to a tile are whatever an earlier product left in the
    # thread's buffer (here NaN): they must not reach the rows written out.
    assert linear(torch.full((15, 1536), float("nan")).bfloat16()).isnan().all()
    assert torch.equal(linear(x[:1]), alone[:1])
    assert torch.equal(linear(x[:3]), alone[:3])


@amx
def test_amx_refuses_widths_its_tiles_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 32"):
        Linear(torch.zeros(8, 48, dtype=torch.bfloat16), None, "amx")
    with pytest.raises(ValueError, match="bfloat16"):
        Linear(torch.zeros(8, 64), None, "amx")


def test_amx_is_refused_where_the_cpu_or_os_offers_no_tiles(monkeypatch):
    # A tile instruction without the OS's grant is an illegal instruction: refused up front.
    features = dict(kernel_paths.cpu_features(), amx_bf16=False)
    monkeypatch.setattr(kernel_paths, "cpu_features", lambda: features)
    with pytest.raises(ValueError, match="no AMX"):
        Linear(torch.zeros(64, 64, dtype=torch.bfloat16), None, "amx")
