"""Walk the start-up tour in a fresh interpreter and print each stop's data as JSON.

Usage: python tour_probe.py OPT_DIR LLAMA_DIR. The test (test_tour.py) runs this in a
subprocess, because plugin loading and platform resolution happen once per process.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(opt_dir: str, llama_dir: str) -> dict:
    data: dict = {}
    import loom
    import loom.platforms as platforms
    from loom_plugin_api import custom_op as custom_op_module
    from loom_plugin_api import loader

    # Stop 2: importing loom resolves nothing.
    data["platform_resolved_at_import"] = platforms._current_platform is not None
    data["general_loaded_at_import"] = loader.general_plugins_loaded()

    # pre_register_and_update is inherited from the base class by the platforms here; wrap it
    # before anything resolves, so that stop 3 happens inside the parser build (stop 4).
    from loom_plugin_api import Platform

    calls: dict[str, list] = {"pre_register": [], "check_and_update": [], "attn_backend": []}
    orig_pre = Platform.pre_register_and_update.__func__

    def pre_register(cls, parser=None):
        calls["pre_register"].append("parser" if parser is not None else "none")
        return orig_pre(cls, parser)

    Platform.pre_register_and_update = classmethod(pre_register)

    # Stops 4-5: building the engine parser runs the general plugins, then the hook.
    from loom.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    EngineArgs.add_cli_args(parser)

    # Stop 3 happened inside: the platform was resolved before the general plugins ran.
    platform = platforms.current_platform
    platform_cls = type(platform)
    data["platform"] = f"{platform_cls.__module__}.{platform_cls.__qualname__}"
    data["is_out_of_tree"] = platform.is_out_of_tree()
    data["verdicts"] = {v.name: {"answer": v.answer, "won": v.won, "raised": v.raised}
                        for v in platforms.detector_verdicts()}
    orig_check = platform_cls.check_and_update_config.__func__
    orig_attn = platform_cls.get_attn_backend_cls.__func__

    def check_and_update(cls, config):
        before = list(config.compilation_config.custom_ops)
        orig_check(cls, config)
        calls["check_and_update"].append(
            {"before": before, "after": list(config.compilation_config.custom_ops),
             "worker_cls": config.parallel_config.worker_cls}
        )

    def attn_backend(cls, *args, **kwargs):
        # the selector's asks (an out-of-tree platform is also asked once per config, to validate its answer)
        if sys._getframe(1).f_globals.get("__name__") == "loom.attention.selector":
            calls["attn_backend"].append(1)
        return orig_attn(cls, *args, **kwargs)

    platform_cls.check_and_update_config = classmethod(check_and_update)
    platform_cls.get_attn_backend_cls = classmethod(attn_backend)
    EngineArgs.add_cli_args(argparse.ArgumentParser())  # a second parser: plugins do not run again
    data["general_plugins"] = {r.name: {"status": r.status, "calls": len(r.calls)}
                               for r in loader.plugin_records("loom.general_plugins")}
    data["op_registry_oot"] = {k: v.__qualname__ for k, v in custom_op_module.op_registry_oot.items()}
    registry = loom.ModelRegistry
    data["registry"] = {}
    for arch in ("MyOPTForCausalLM", "MyLlama", "LlamaForCausalLM", "OPTForCausalLM"):
        entry = registry.models.get(arch)
        if entry is not None:
            data["registry"][arch] = {
                "eager_info": type(entry).__name__ == "_RegisteredModel",
                "imported": getattr(entry, "is_imported", True),
            }
    data["my_llama_module_loaded"] = "loom_add_dummy_model.my_llama" in sys.modules

    # Stops 5-7: config creation.
    use_plugin_models = "MyOPTForCausalLM" in registry.models
    opt_arch = "MyOPTForCausalLM" if use_plugin_models else "OPTForCausalLM"
    args = parser.parse_args(["--model", opt_dir, "--hf-overrides", json.dumps({"architectures": [opt_arch]}),
                              "--custom-ops", "none"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    data["opt_architecture"] = config.model_config.architecture
    data["device_type"] = config.device_config.device_type

    # Stops 10-15 (in this process for now): build and run the models.
    from loom import LLM, SamplingParams
    from loom.attention import selector
    from loom_plugin_api.ops.layernorm import LayerNorm
    from loom_plugin_api.ops.rotary_embedding import RotaryEmbedding

    selector._cache_clear()
    llama_arch = "MyLlama" if use_plugin_models else "LlamaForCausalLM"
    llm = LLM(llama_dir, hf_overrides={"architectures": [llama_arch]}, max_model_len=128)
    data["my_llama_module_loaded_after_llm"] = "loom_add_dummy_model.my_llama" in sys.modules
    model = llm.llm_engine.executor.worker.model_runner.model
    data["llama_model_cls"] = type(model).__name__
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    data["rope"] = sorted({(type(m).__name__, m.forward_method_name) for m in ropes})
    data["attn_backend_asks"] = len(calls["attn_backend"])
    data["num_attention_layers"] = len(llm.llm_engine.executor.worker.model_runner.attn_layers)
    before_calls = 0
    dummy_rope = custom_op_module.op_registry_oot.get("RotaryEmbedding")
    if dummy_rope is not None:
        before_calls = dummy_rope.forward_oot_calls
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, temperature=0))
    data["generated"] = len(out[0].outputs[0].token_ids)
    data["forward_oot_calls"] = (dummy_rope.forward_oot_calls - before_calls) if dummy_rope else 0

    llm_opt = LLM(opt_dir, hf_overrides={"architectures": [opt_arch]}, max_model_len=128)
    opt_model = llm_opt.llm_engine.executor.worker.model_runner.model
    norms = [m for m in opt_model.modules() if isinstance(m, LayerNorm)]
    data["opt_norms"] = sorted({(type(m).__name__, m.forward_method_name) for m in norms})
    data["calls"] = calls

    from loom import envs

    data["envs_cache_enabled"] = envs.is_envs_cache_enabled()
    return data


if __name__ == "__main__":
    print("TOUR-JSON " + json.dumps(main(sys.argv[1], sys.argv[2])))
