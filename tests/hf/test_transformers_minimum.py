"""The transformers lower bound: an older version is refused on first use, the extras pin the minimum, and
every VLM path works and matches HF at that minimum (the last test installs it into a temporary folder).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
import pytest

pytest.importorskip("transformers")

import slabstage.hf as sshf  # noqa: E402
from slabstage.hf._family import MIN_TRANSFORMERS  # noqa: E402


ROOT = Path(__file__).resolve().parents[2]


def test_older_transformers_is_refused_on_first_use(models, monkeypatch):
    import transformers

    model = models("qwen2_vl")
    monkeypatch.setattr(transformers, "__version__", "5.0.0")
    for fn in (sshf.input_embeds_width, sshf.prefill_forward, sshf.media_items):
        with pytest.raises(ImportError, match=rf"needs transformers>={MIN_TRANSFORMERS},<6, found 5.0.0"):
            fn(model)
    monkeypatch.setattr(transformers, "__version__", MIN_TRANSFORMERS)
    assert sshf.input_embeds_width(model) == 32


def test_extras_pin_the_supported_minimum():
    text = (ROOT / "pyproject.toml").read_text()
    major_minor = ".".join(MIN_TRANSFORMERS.split(".")[:2])
    for extra in ("hf", "test"):
        body = re.search(rf"^{extra} = \[(.*?)\]", text, re.M | re.S).group(1)
        assert f'"transformers>={major_minor},<6"' in body, f"[project.optional-dependencies] {extra}: {body}"
    assert f"transformers>={major_minor},<6" in (ROOT / "docs" / "hf.md").read_text()


_LOWER_BOUND_CHECK = r'''
import json, os, sys
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import transformers
assert transformers.__version__ == sys.argv[1], (transformers.__version__, transformers.__file__)
import slabstage as ss, slabstage.hf as sshf
from slabstage.hf.tiny import tiny_model, tiny_prompt

worst = {}
for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
    model = tiny_model(family)
    width = sshf.input_embeds_width(model)
    assert width == 32 * (3 if family.startswith("qwen3") else 1), (family, width)
    g = torch.Generator().manual_seed(0)
    requests, refs = [], []
    for grids in ([(1, 4, 6)], [(1, 4, 4), (1, 6, 4)]):
        ids, pv, grid = tiny_prompt(model, grids, generator=g)
        pos = sshf.mrope_positions(model, ids, grid)
        assert pos.shape == (3, ids.shape[0]) and not torch.equal(pos[1], pos[2]), family
        requests.append(sshf.Request(ids, sshf.media_items(model, pixel_values=pv, image_grid_thw=grid),
                                     image_grid_thw=grid))
        kw = dict(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], use_cache=False,
                  pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=sshf.mm_token_type_ids(model, ids[None]))
        with torch.no_grad():
            refs.append(model.base_model(**kw).last_hidden_state[0])
    buffers = ss.StagingBuffers.allocate(max_num_tokens=128, max_batch_size=4, embed_width=width,
                                         embed_dtype=torch.float32, device="cpu", mrope=True)
    runner = ss.PrefillGraphRunner(sshf.prefill_forward(model), buffers, progress=False)
    runner.capture()
    batch = sshf.pack_requests(model, requests)
    with torch.no_grad():
        out = runner.run(batch, clone=True)
    worst[family] = max((out[s:s + n] - ref).abs().max().item() for ref, s, n in
                        zip(refs, batch.extend_start_loc.tolist(), batch.seq_lens.tolist()))
print(json.dumps({"version": transformers.__version__, "file": transformers.__file__, "worst": worst}))
'''


def _pip(*args, timeout=240):
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", f"timed out after {timeout} s")


def _lower_bound_site(version: str) -> Path:
    """A folder holding transformers ``version`` and the packages this environment lacks for it (an older
    huggingface_hub, tokenizers, ...), cached in the temp dir by version; skips when pip cannot fetch them."""
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    cache = Path(tempfile.gettempdir()) / f"slabstage-transformers-{version}-{python}"
    site, done = cache / "site", cache / "site.ok"
    if done.exists():
        return site
    cache.mkdir(parents=True, exist_ok=True)
    report = cache / "report.json"
    # what installing that version here would add or replace: only that goes to the folder, the rest
    # (torch, numpy, ...) stays this environment's (a dry run: nothing here is installed)
    r = _pip("install", "--dry-run", "--quiet", "--report", report, f"transformers=={version}")
    if r.returncode:
        pytest.skip(f"pip could not resolve transformers=={version} (offline?): {r.stderr.strip()[-300:]}")
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(report.read_text())["install"]]
    wheels = cache / "wheels"
    r = _pip("download", "--no-deps", "--quiet", "-d", wheels, *pins) if pins else r
    if r.returncode:
        pytest.skip(f"pip could not download {' '.join(pins)} (offline?): {r.stderr.strip()[-300:]}")
    part = cache / f"site-{os.getpid()}"
    if pins:
        r = _pip("install", "--no-deps", "--no-index", "--no-compile", "--quiet", "--find-links", wheels,
                 "--target", part, *pins)
        assert r.returncode == 0, f"installing the downloaded wheels failed:\n{r.stderr[-3000:]}"
    else:  # this environment has that version already
        part.mkdir()
    try:
        part.rename(site)
    except OSError:  # another run got there first
        assert site.is_dir()
    done.touch()
    return site


@pytest.mark.slow  # (40 s on the 2-core machine: pip resolves, downloads and installs that version first)
def test_vlm_paths_work_and_match_hf_at_the_minimum_transformers():
    site = _lower_bound_site(MIN_TRANSFORMERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    proc = subprocess.run([sys.executable, "-c", _LOWER_BOUND_CHECK, MIN_TRANSFORMERS], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"at transformers {MIN_TRANSFORMERS}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["version"] == MIN_TRANSFORMERS
    assert all(err <= 1e-4 for err in result["worst"].values()), result
