"""How the slot KV cache is handed to a transformers model's forward (kv_cache.cache_keyword);
the cache's own behaviour is tested through the runners (tests/verifier/engine/
test_tree_attention.py)."""

import warnings

import torch

from sssd.common.model.kv_cache import cache_keyword


def test_the_cache_goes_under_the_name_the_forward_takes():
    class Renamed(torch.nn.Module):  # transformers >= 5.24
        def forward(self, input_ids=None, cache=None, past_key_values=None):
            return cache

    class Older(torch.nn.Module):  # transformers 5.0-5.23
        def forward(self, input_ids=None, past_key_values=None):
            return past_key_values

    assert cache_keyword(Renamed()) == "cache"
    assert cache_keyword(Older()) == "past_key_values"


def test_the_installed_models_take_the_cache_without_a_deprecation_warning(target_model_fp32):
    model = target_model_fp32.model
    for module in (model, model.base_model):
        keyword = cache_keyword(module)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated keyword would raise here
            with torch.inference_mode():
                module(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False, **{keyword: None})
