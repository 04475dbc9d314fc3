"""A general plugin extends what a flag accepts: --load-format choices are read after plugins ran."""

from __future__ import annotations

from fake_dist import run_python, write_fake_dist

PLUGIN = """
import torch

def register():
    from loom.model_loader import register_weight_loader

    def load_zeros(model, config, show_progress):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        print("ZEROS LOADER RAN", flush=True)
        return "zeros"

    register_weight_loader("zeros", load_zeros)
"""


def test_general_plugin_adds_a_load_format(tmp_path, tiny_llama):
    write_fake_dist(tmp_path, "fake-zeros", {"loom.general_plugins": {"zeros_format": "fakezeros:register"}},
                    "fakezeros", PLUGIN)
    code = ("from loom.entrypoints.cli.main import main; raise SystemExit(main(['generate', 'hi', '--model', "
            f"{str(tiny_llama)!r}, '--load-format', 'zeros', '--max-tokens', '2', '--raw']))")
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ZEROS LOADER RAN" in proc.stdout
    # without the plugin the choice does not exist
    proc = run_python(code, None)
    assert proc.returncode == 2 and "invalid choice: 'zeros'" in proc.stderr
