"""The kernel paths: chosen once, from the CPU's features, in one module (kernel_paths and the C++
cpu_paths it reads), named for every kernel, and overridden for tests by one call that refuses
what the CPU cannot run and leaves everything as it was afterwards."""

import logging

import pytest
import torch

from sssd.common.model import kernel_paths

FEATURES = kernel_paths.cpu_features()
logger = logging.getLogger(__name__)


def expected_paths() -> dict[str, dict[str, str]]:
    """What this CPU's features should give, written from them independently of the C++."""
    avx512, bf16, amx, avx2 = (FEATURES[name] for name in
                               ("avx512", "avx512_bf16", "amx_bf16", "avx2_fma"))
    tree = "avx512" if avx512 else "avx2" if avx2 else "portable"
    return {
        "tree_attention": {"float32": tree, "bfloat16": tree},
        "attention_scores": {
            "float32": "avx512" if avx512 else "none",
            "bfloat16": ("amx" if amx else "dpbf16" if bf16 else "avx512") if avx512 else "none"},
        "panels": {"float32": "avx512" if avx512 else "avx2" if avx2 else "none",
                   "bfloat16": "avx512" if bf16 else "avx2" if avx2 else "none"},
        "argmax": dict.fromkeys(("float32", "bfloat16"), "avx512" if avx512 else "portable"),
    }


def test_every_kernel_is_named_with_the_path_this_cpu_runs():
    chosen = kernel_paths.chosen()
    logger.info("kernel paths on this CPU (%s): %s", FEATURES, chosen)
    assert set(chosen) == set(kernel_paths.KERNELS)
    products = chosen.pop("products")
    assert chosen == expected_paths()
    assert products["bfloat16"] == ("amx" if FEATURES["amx_bf16"] else "panels"
                                    if expected_paths()["panels"]["bfloat16"] != "none"
                                    else kernel_paths.possible_products(
                                        torch.bfloat16, torch.device("cpu"))[0])
    assert kernel_paths.products(torch.float32, torch.device("meta")) == "plain"


OVERRIDES = [("tree_attention", "portable"), ("tree_attention", "avx2"),
             ("attention_scores", "avx512"), ("attention_scores", "dpbf16"),
             ("attention_scores", "amx"), ("panels", "avx2"),
             ("argmax", "portable"), ("products", "onednn"), ("products", "plain")]


@pytest.mark.parametrize("kernel,path", OVERRIDES)
def test_one_override_forces_a_path_and_restores_the_choice(kernel, path):
    before = kernel_paths.chosen()
    can = {"avx2": FEATURES["avx2_fma"], "dpbf16": FEATURES["avx512_bf16"],
           "amx": FEATURES["amx_bf16"], "avx512": FEATURES["avx512"]}.get(path, True)
    if kernel == "products":
        can = path in kernel_paths.possible_products(torch.bfloat16, torch.device("cpu"))
    if not can:
        with pytest.raises(ValueError):
            with kernel_paths.forced(**{kernel: path}):
                pass
        assert kernel_paths.chosen() == before
        return
    with kernel_paths.forced(**{kernel: path}):
        forced = kernel_paths.chosen()[kernel]
        assert forced["bfloat16"] == path
        if kernel != "attention_scores":  # the float32 scores are the vector loop's always
            assert forced["float32"] == path or kernel == "products"
        others = {k: v for k, v in kernel_paths.chosen().items() if k != kernel}
        assert others == {k: v for k, v in before.items() if k != kernel}
    assert kernel_paths.chosen() == before


def test_an_override_refuses_unknown_kernels_and_paths():
    before = kernel_paths.chosen()
    with pytest.raises(ValueError, match="unknown kernels"):
        with kernel_paths.forced(attention="avx2"):
            pass
    with pytest.raises(ValueError, match="cannot run"):
        with kernel_paths.forced(tree_attention="neon"):
            pass
    with pytest.raises(ValueError, match="products must be"):
        with kernel_paths.forced(products="cuda"):
            pass
    assert kernel_paths.chosen() == before


def test_overrides_nest_and_unwind_after_an_error():
    before = kernel_paths.chosen()
    with pytest.raises(RuntimeError):
        with kernel_paths.forced(tree_attention="portable"):
            with kernel_paths.forced(argmax="portable", tree_attention="portable"):
                raise RuntimeError("inside")
    assert kernel_paths.chosen() == before
