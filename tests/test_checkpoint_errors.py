"""Bad inputs stop with a message naming the file and leave nothing that looks finished;
an interrupted conversion resumes without redoing finished layers."""
import shutil

import numpy as np
import pytest
import torch

from opt_serving.checkpoint import convert as convert_mod
from opt_serving.checkpoint.convert import convert
from opt_serving.checkpoint.formats import CheckpointError
from opt_serving.checkpoint.md5 import write_md5_csv
from opt_serving.checkpoint.writer import UnitWriter
from opt_serving.cli import main
from opt_serving.model.weights import load_numpy_folder
from opt_serving.testing import checkpoints as ck


@pytest.fixture(scope="module")
def tiny():
    return ck.random_hf_model(ck.tiny_config(), seed=5)


@pytest.fixture
def shards(tiny, tmp_path):
    return ck.write_fsdp_shards(tmp_path / "ckpt", tiny, parts=2, shards=3)


def fails(tmp_path, capsys, *extra, src=None) -> str:
    """Run the CLI, expect failure; return stderr. Checks nothing complete-looking was left."""
    out = tmp_path / "np"
    rc = main(["convert", "--input", str(src or tmp_path / "ckpt"), "--output", str(out), "--no-progress",
               *extra])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error: " in err
    assert not out.exists()
    assert not (tmp_path / "np.partial" / "config.json").exists()
    return err


def test_deleted_shard_in_the_middle(shards, tmp_path, capsys):
    shards[4].unlink()  # part 1, shard 1
    assert f"missing shard {shards[4]}" in fails(tmp_path, capsys)


def test_deleted_trailing_shards_of_every_part(shards, tmp_path, capsys):
    shards[2].unlink()
    shards[5].unlink()  # shard2 of both parts: the grid looks complete, the cfg's world size does not
    err = fails(tmp_path, capsys)
    assert "distributed_world_size 6" in err and "checkpoint_last-model_part-0-shard2.pt" in err


def test_truncated_shard(shards, tmp_path, capsys):
    data = shards[3].read_bytes()
    shards[3].write_bytes(data[: len(data) // 2])
    err = fails(tmp_path, capsys)
    assert f"cannot read {shards[3]}" in err and "truncated or corrupt" in err


def test_wrong_md5(shards, tmp_path, capsys):
    csv = tmp_path / "md5.csv"
    write_md5_csv(shards, csv)
    lines = csv.read_text().splitlines()
    lines[2] = lines[2].split(",")[0] + "," + "0" * 32  # second entry in lexical order
    csv.write_text("\n".join(lines) + "\n")
    bad = tmp_path / "ckpt" / lines[2].split(",")[0]
    err = fails(tmp_path, capsys, "--md5", str(csv))
    assert f"md5 mismatch for {bad}" in err


def test_md5_lists_a_missing_file(shards, tmp_path, capsys):
    csv = tmp_path / "md5.csv"
    write_md5_csv(shards, csv)
    csv.write_text(csv.read_text() + "checkpoint_last-model_part-0-shard3.pt," + "a" * 32 + "\n")
    err = fails(tmp_path, capsys, "--md5", str(csv))
    assert f"missing {tmp_path / 'ckpt' / 'checkpoint_last-model_part-0-shard3.pt'}" in err


def test_md5_passes_then_converts(shards, tmp_path, tiny):
    csv = tmp_path / "md5.csv"
    write_md5_csv(shards, csv)
    convert(tmp_path / "ckpt", tmp_path / "np", md5_csv=csv, log=lambda m: None, progress=False)
    _, params = load_numpy_folder(tmp_path / "np")
    np.testing.assert_array_equal(params["decoder.layers.1.fc1.bias"],
                                  ck.metaseq_state_dict(tiny)["decoder.layers.1.fc1.bias"].numpy())


def test_shard_from_another_model(shards, tmp_path, capsys):
    other = ck.random_hf_model(ck.tiny_config(hidden=16, heads=2), seed=9)
    foreign = ck.write_fsdp_shards(tmp_path / "other", other, parts=2, shards=3)
    shutil.copyfile(foreign[4], shards[4])
    err = fails(tmp_path, capsys)
    assert str(shards[4]) in err and "another model" in err


def test_replicated_parameter_differs_between_parts(tiny, tmp_path, capsys):
    files = ck.write_reshard_parts(tmp_path / "ckpt", tiny, parts=2)
    data = torch.load(files[1], weights_only=False)
    data["model"]["decoder.layers.1.final_layer_norm.bias"] += 1
    torch.save(data, files[1])
    err = fails(tmp_path, capsys)
    assert f"{files[1]}: decoder.layers.1.final_layer_norm.bias differs from model-parallel part 0" in err


def test_unexpected_key_and_shape_mismatch(tiny, tmp_path, capsys):
    path = ck.write_singleton(tmp_path / "ckpt" / "restored.pt", tiny)
    data = torch.load(path, weights_only=False)
    data["model"]["decoder.layers.0.adapter.weight"] = torch.zeros(3)
    torch.save(data, path)
    assert f"{path}: unexpected key decoder.layers.0.adapter.weight" in fails(tmp_path, capsys)
    del data["model"]["decoder.layers.0.adapter.weight"]
    data["model"]["decoder.layers.1.fc2.weight"] = torch.zeros(32, 64, dtype=torch.float16)
    torch.save(data, path)
    err = fails(tmp_path, capsys)
    assert f"{path}: shape mismatch for decoder.layers.1.fc2.weight: the file has (32, 64)" in err


def test_singleton_without_cfg_needs_config(tiny, tmp_path, capsys):
    path = ck.write_singleton(tmp_path / "ckpt" / "restored.pt", tiny, with_cfg=False)
    assert "pass --config" in fails(tmp_path, capsys)
    cfg_json = tmp_path / "config.json"
    ck._opt_config(tiny).save_hf_json(cfg_json)
    convert(path, tmp_path / "np", config=str(cfg_json), log=lambda m: None, progress=False)
    assert load_numpy_folder(tmp_path / "np")[0] == ck._opt_config(tiny)


def test_one_part_alone_is_not_taken_for_a_singleton(tiny, tmp_path, capsys):
    files = ck.write_reshard_parts(tmp_path / "ckpt", tiny, parts=2)
    files[1].unlink()
    lone = files[0].rename(tmp_path / "ckpt" / "restored.pt")
    err = fails(tmp_path, capsys, src=lone)
    assert f"{lone}: cfg says model_parallel_size 2 and its attention holds 16 of 32 rows" in err
    assert "pass all 2 parts" in err


def test_unsafe_pickle_is_refused(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    (tmp_path / "ckpt").mkdir()
    torch.save({"model": {}, "cfg": Evil()}, tmp_path / "ckpt" / "restored.pt")
    err = fails(tmp_path, capsys)
    assert "cannot read" in err and "pwned" not in capsys.readouterr().out


def test_existing_output_is_not_replaced(shards, tmp_path, capsys):
    (tmp_path / "np").mkdir()
    rc = main(["convert", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "np"), "--no-progress"])
    assert rc == 1 and "already exists" in capsys.readouterr().err


def test_interrupted_conversion_resumes(shards, tiny, tmp_path, monkeypatch):
    finished = []
    real_finish = UnitWriter.finish

    def finish_then_crash(self):
        real_finish(self)
        finished.append(self)
        if len(finished) == 3:  # globals and layer 0 were marked done; layer 1 was not yet
            raise KeyboardInterrupt

    monkeypatch.setattr(UnitWriter, "finish", finish_then_crash)
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "ckpt", tmp_path / "np", log=lambda m: None, progress=False)
    assert not (tmp_path / "np").exists() and (tmp_path / "np.partial").exists()
    monkeypatch.setattr(UnitWriter, "finish", real_finish)

    read = []
    real_open = convert_mod.open_reader

    def spying_open(*args):
        reader = real_open(*args)
        real_read = reader.read_unit
        reader.read_unit = lambda unit, w: (read.append(unit), real_read(unit, w))
        return reader

    monkeypatch.setattr(convert_mod, "open_reader", spying_open)
    result = convert(tmp_path / "ckpt", tmp_path / "np", log=lambda m: None, progress=False)
    assert read == ["layer.1"] and result.units_skipped == 2
    assert not (tmp_path / "np.partial").exists()
    cfg, params = load_numpy_folder(tmp_path / "np")
    for key, t in ck.metaseq_state_dict(tiny).items():
        np.testing.assert_array_equal(params[key], t.numpy(), err_msg=key)


def test_partial_folder_from_other_inputs_is_not_reused(shards, tiny, tmp_path):
    stale = tmp_path / "np.partial" / ".progress"
    stale.mkdir(parents=True)
    (stale / "source.json").write_text('{"format": "something else"}')
    (stale / "globals").write_text("done\n")  # a lie: must not be trusted
    convert(tmp_path / "ckpt", tmp_path / "np", log=lambda m: None, progress=False)
    _, params = load_numpy_folder(tmp_path / "np")
    np.testing.assert_array_equal(params["decoder.embed_tokens.weight"],
                                  ck.metaseq_state_dict(tiny)["decoder.embed_tokens.weight"].numpy())


def test_unknown_format_choice_is_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint files at"):
        convert(tmp_path / "nothing*.pt", tmp_path / "np", log=lambda m: None)
