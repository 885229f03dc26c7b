"""torch is an optional extra (`opt_serving[torch]`): without it the embedded model loads and serves, and what does
need it (the checkpoint converter, the facebook/ reference backend) says what to install. The child process sees
this venv's packages minus torch, as a fresh install without the extra would (python -S: no .pth files)."""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("torch", "functorch", "torchgen", "nvidia", "triton")  # torch's own packages and its CUDA wheels

CHILD = """
    import importlib.util, json, sys
    assert importlib.util.find_spec("torch") is None, "torch is visible"
    from starlette.testclient import TestClient
    from opt_serving.errors import MissingExtra
    from opt_serving.text.loading import load_generator
    from opt_serving.service.app import create_app
    from opt_serving.model.embedded import ensure_embedded_model
    gen = load_generator("jax/opt-tiny", str(ensure_embedded_model()), max_batch_size=2, max_seq_len=64,
                                   warmup=False)
    with TestClient(create_app(gen, close_generator=True)) as client:
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0})
    out = {"status": r.status_code, "text": r.json()["choices"][0]["text"]}
    from opt_serving.model.wrapper import get_model
    try:
        get_model("facebook/opt-125m", dummy=True)
    except MissingExtra as e:
        out["facebook"] = str(e)
    from opt_serving import cli
    import contextlib, io
    with contextlib.redirect_stderr(io.StringIO()) as err:
        out["convert_rc"] = cli.main(["convert", "--input", "x", "--output", "y"])
    out["convert_err"] = err.getvalue()
    out["torch_imported"] = "torch" in sys.modules
    print(json.dumps(out))
"""


def _site_without_torch(tmp_path: Path) -> Path:
    site = Path(sysconfig.get_paths()["purelib"])
    out = tmp_path / "site"
    out.mkdir()
    for entry in site.iterdir():
        if entry.suffix == ".pth" or entry.name.lower().startswith(HIDDEN):
            continue
        (out / entry.name).symlink_to(entry)
    return out


def test_the_embedded_model_serves_without_torch_and_the_extras_say_what_to_install(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{_site_without_torch(tmp_path)}",
           "OPT_SERVING_CACHE": os.environ.get("OPT_SERVING_CACHE", str(Path.home() / ".cache" / "opt_serving"))}
    r = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(CHILD)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"child exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["status"] == 200 and out["text"]
    assert not out["torch_imported"]
    assert "pip install 'opt_serving[torch]'" in out["facebook"] and "facebook/" in out["facebook"]
    assert out["convert_rc"] == 2 and "opt-serving convert needs torch" in out["convert_err"]
    # the same text as this process, which has torch, serves
    from starlette.testclient import TestClient
    from opt_serving.model.embedded import ensure_embedded_model
    from opt_serving.text.loading import load_generator
    from opt_serving.service.app import create_app
    gen = load_generator("jax/opt-tiny", str(ensure_embedded_model()), max_batch_size=2, max_seq_len=64,
                                   warmup=False)
    with TestClient(create_app(gen, close_generator=True)) as client:
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["text"] == out["text"]
