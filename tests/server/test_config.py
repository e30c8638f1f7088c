"""Config loading: file, environment and overrides; every bad key or value is named."""

from __future__ import annotations

import json

import pytest

from strata.config import Config, ConfigError, config_from_dict, load_config


def test_file_environment_and_overrides_in_order(tmp_path):
    path = tmp_path / "strata.json"
    path.write_text(json.dumps({"model": "a.gguf", "port": 9000, "api_key": "from-file",
                                "limits": {"max_tokens": 100, "queue_length": 3}, "vision": {"gpu": True}}))
    config = load_config(path, {"port": 9001, "limits": {"max_tokens": 7}}, environ={"STRATA_API_KEY": "env"})
    assert (config.model, config.port, config.api_key) == ("a.gguf", 9001, "env")
    assert (config.limits.max_tokens, config.limits.queue_length) == (7, 3)
    assert config.vision.gpu is True


def test_strata_config_names_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"context": 1024}))
    assert load_config(environ={"STRATA_CONFIG": str(path)}).context == 1024


def test_defaults():
    assert load_config(environ={}) == Config()


@pytest.mark.parametrize(("data", "message"), [
    ({"vision": {"gpuu": True}}, 'unknown key "vision.gpuu"'),
    ({"modle": "x"}, 'unknown key "modle"'),
    ({"port": "80"}, '"port" must be int'),
    ({"port": 70000}, '"port" must be 0..65535'),
    ({"kv": "q4"}, '"kv" must be one of'),
    ({"threads": 0}, '"threads" must be at least 1'),
    ({"threads": True}, '"threads" must be int'),
    ({"step_slowdown": 0.5}, '"step_slowdown" must be at least 1'),
    ({"device": "gpu"}, '"device" must be one of cpu, cuda, host'),
    ({"gpu_memory": 0}, '"gpu_memory" must be positive'),
    ({"step_slowdown": float("nan")}, '"step_slowdown" must be at least 1'),
    ({"context": None}, '"context" must not be null'),
    ({"limits": []}, '"limits" must be an object'),
    ({"limits": {"max_body_bytes": 0}}, '"limits.max_body_bytes" must be at least 1'),
    ({"limits": {"graceful_timeout": -1}}, '"limits.graceful_timeout" must be positive'),
    ({"vision": {"exe": "strata-vision"}}, '"vision.exe" must be a non-empty list of strings'),
    ({"vision": {"max_tokens": 0}}, '"vision.max_tokens" must be at least 1'),
    ({"vision": {"min_tokens": 0}}, '"vision.min_tokens" must be at least 1'),
    ({"sampling": {"temperature": "hot"}}, '"sampling.temperature" must be float'),
    ({"kv_disk": {"max_bytes": 0}}, '"kv_disk.max_bytes" must be at least 1'),
    ({"kv_disk": {"block_tokens": 0}}, '"kv_disk.block_tokens" must be at least 1'),
    ({"kv_disk": {"path": " "}}, '"kv_disk.path" must be a directory'),
    ({"kv_disk": {"paht": "x"}}, 'unknown key "kv_disk.paht"'),
])
def test_bad_keys_and_values_are_named(data, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_from_dict(data)


def test_vision_keys_are_accepted():
    vision = {"mmproj": "v.gguf", "gpu": False, "threads": 2, "max_tokens": 512, "exe": ["ssh", "box", "strata-vision"],
              "remote": True, "lazy_load": True}
    assert config_from_dict({"vision": vision}).vision.exe == ["ssh", "box", "strata-vision"]


def test_the_kv_disk_flags_set_the_section():
    import argparse

    from strata.cli.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--kv-disk.path", "/srv/kv", "--kv-disk.max-bytes", "1000000"]))
    assert (config.kv_disk.path, config.kv_disk.max_bytes, config.kv_disk.block_tokens) == ("/srv/kv", 10**6, 256)


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json", environ={})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad, environ={})


def test_every_flag_says_what_it_is_and_its_default():
    import argparse

    from strata.cli.flag_help import HELP
    from strata.cli.serve import add_arguments
    from strata.config import flag_names

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {action.dest.removeprefix("cfg:"): action.help for action in parser._actions}
    assert set(HELP) <= {key for key, _ in flag_names()}  # no help for a key that is gone
    assert "(default: 4096)" in helps["context"] and "tokens" in helps["context"]
    assert "(default: 60.0)" in helps["limits.body_timeout"] and "seconds" in helps["limits.body_timeout"]
    assert all("config key" in text for key, text in helps.items() if key not in ("help", "config"))


# --- several models


TWO = [{"name": "coder", "model": "coder.gguf", "aliases": ["code"], "context": 8192, "slots": 2},
       {"name": "small", "model": "small.gguf", "mmproj": "small-mmproj.gguf"}]


def test_each_model_entry_is_the_top_level_config_with_its_own_keys():
    config = config_from_dict({"models": TWO, "context": 2048, "kv": "int8", "vision": {"threads": 3},
                               "models_memory": "12GiB"})
    coder, small = (config.for_model(entry) for entry in config.models)
    assert config.models_memory == 12 * 2**30
    assert (coder.model, coder.model_alias, coder.context, coder.slots, coder.kv) == \
        ("coder.gguf", "coder,code", 8192, 2, "int8")
    assert (coder.vision.mmproj, small.vision.mmproj, small.vision.threads) == (None, "small-mmproj.gguf", 3)
    assert (small.context, small.slots, small.models) == (2048, 4, [])
    own = config_from_dict({"models": [{**TWO[1], "vision": {"threads": 1, "gpu": True}}], "vision": {"threads": 3}})
    vision = own.for_model(own.models[0]).vision
    assert (vision.mmproj, vision.threads, vision.gpu, own.vision.threads) == ("small-mmproj.gguf", 1, True, 3)
    assert config.model_files() == ["coder.gguf", "small.gguf"]
    hub = config_from_dict({"models": [*TWO, {"name": "hub", "model": "hf:owner/name:Q8_0"}]})
    assert hub.model_files() == ["coder.gguf", "small.gguf"]  # downloaded when first named, not checked at startup


@pytest.mark.parametrize(("value", "size"), [(1000, 1000), ("800MB", 800 * 10**6), ("1.5 GiB", 3 * 2**29),
                                             ("64kib", 65536), ("10", 10)])
def test_models_memory_takes_bytes_or_a_size(value, size):
    assert config_from_dict({"models_memory": value}).models_memory == size


@pytest.mark.parametrize(("data", "message"), [
    ({"models": {"coder": {}}}, '"models" must be a list of objects'),
    ({"models": [{"model": "a.gguf"}]}, '"models[0].name" is required'),
    ({"models": [{"name": "a"}]}, '"models[0].model" is required'),
    ({"models": [{"name": "a", "model": "a.gguf", "contxt": 1}]}, 'unknown key "models[0].contxt"'),
    ({"models": [{"name": "a", "model": "a.gguf", "slots": 0}]}, '"models[0].slots" must be at least 1'),
    ({"models": [{"name": "a", "model": "a.gguf", "kv": "q4"}]}, '"models[0].kv" must be one of'),
    ({"models": [{"name": "a", "model": "a.gguf"}, {"name": "b", "model": "b.gguf", "aliases": ["a"]}]},
     '"models[1]" serves the name \'a\''),
    ({"models": [{"name": " a", "model": "a.gguf"}]}, '"models[0].name" must be a non-empty name'),
    ({"models": [{"name": "a", "model": "hf:nobody"}]}, '"models[0].model"'),
    ({"model": "x.gguf", "models": TWO}, '"model" names one model'),
    ({"model_alias": "x", "models": TWO}, '"model_alias" names one model'),
    ({"models": [{"name": "a", "model": "a.gguf", "vision": {"gpuu": True}}]}, 'unknown key "models[0].vision.gpuu"'),
    ({"models": [{"name": "a", "model": "a.gguf", "vision": {"threads": "2"}}]}, '"models[0].vision.threads" must be'),
    ({"models": [{"name": "a", "model": "a.gguf", "vision": {"mmproj": "m"}}]}, '"models[0].vision.mmproj" is the'),
    ({"models": [{"name": "a", "model": "a.gguf", "vision": []}]}, '"models[0].vision" must be an object'),
    ({"models_memory": "lots"}, '"models_memory" must be a number of bytes or a size'),
    ({"models_memory": 0}, '"models_memory" must be at least 1 byte'),
    ({"models": TWO, "kv_events": {"endpoint": "tcp://*:5557"}}, '"kv_events.endpoint" serves one model'),
])
def test_bad_model_entries_are_named(data, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(data)


def test_several_models_keep_their_disk_blocks_in_directories_of_their_own(tmp_path):
    """Each model's tier removes another model's blocks at startup: one directory each, named after the model."""
    config = config_from_dict({"models": [*TWO, {"name": "org/odd name", "model": "c.gguf"}],
                               "kv_disk": {"path": str(tmp_path)}})
    paths = [config.for_model(entry).kv_disk.path for entry in config.models]
    assert paths == [str(tmp_path / "coder"), str(tmp_path / "small"), str(tmp_path / "org_odd_name")]
    plain = config_from_dict({"models": TWO})
    assert plain.for_model(plain.models[0]).kv_disk.path is None
