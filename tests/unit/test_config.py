"""`meshlm serve`'s flags parsed into the typed config: a value that cannot mean anything is refused there,
in a sentence naming the flag, before anything starts (each of these once started a server)."""

from __future__ import annotations

import pytest

from meshlm import cli


def parse(*flags: str):
    return cli.serve_config(cli.build_parser().parse_args(["serve", "--model", "demo", *flags]))


def test_a_chat_template_from_a_file_or_inline_and_its_default_variables(tmp_path):
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}" + "x" * 5000  # too long for a file name
    assert parse("--chat-template", inline).server.chat_template == inline
    # transformers' own tags and extensions (a plain jinja2 environment refused them)
    for text in ("{% for m in messages %}{{ m.content }}{% break %}{% endfor %}",
                 "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"):
        assert parse("--chat-template", text).server.chat_template == text
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    assert parse("--chat-template", str(tmp_path / "t.jinja")).server.chat_template == "{{ messages[0].content }}"
    config = parse("--chat-template-args", '{"enable_thinking": false}').server
    assert config.chat_template_kwargs == {"enable_thinking": False} and config.chat_template is None


def test_the_defaults_parse():
    config = parse()
    assert config.parallel.start_timeout == 180.0 and config.server.max_tokens_default >= 1
    assert config.server.allowed_origins == ()  # no browser page may call the API unless allowed
    assert config.scheduler.long_prefill_context == 8192 and parse("--long-prefill-context", "0").scheduler.long_prefill_context == 0
    assert parse("--allowed-origins", "https://a.example:8443, http://[::1]:3000").server.allowed_origins == \
        ("https://a.example:8443", "http://[::1]:3000")


def test_a_draft_model_alone_speculates_with_it_as_mlx_lm_servers_does():
    assert parse().speculative.method == "off"
    spec = parse("--draft-model", "small").speculative  # was accepted and ignored
    assert spec.method == "draft" and spec.draft_model == "small"


@pytest.mark.parametrize("flags, words", [
    (("--step-timeout", "0"), "--step-timeout must be a number > 0"),
    (("--step-timeout", "-1"), "--step-timeout must be a number > 0"),
    (("--step-timeout", "nan"), "--step-timeout must be a number > 0"),
    (("--worker-timeout", "nan"), "--worker-timeout must be a number > 0"),
    (("--worker-timeout", "inf"), "--worker-timeout must be a number > 0"),
    (("--start-timeout", "0"), "--start-timeout must be a number > 0"),
    # accepted, these ended the cluster at its first request (or a worker at its first late heartbeat)
    (("--tensor-parallel", "2", "--step-timeout", "0.000001"), "--step-timeout must be at least 1 s"),
    (("--worker-timeout", "0.6"), "--worker-timeout must be at least 1 s"),
    (("--ssd-cache-gb", "nan"), "--ssd-cache-gb must be a number > 0"),  # was "cannot convert float NaN"
    (("--ssd-ttl-days", "nan"), "--ssd-ttl-days must be a number > 0"),
    (("--ssd-ttl-days", "-1"), "--ssd-ttl-days must be a number > 0"),
    (("--max-tokens-default", "0"), "--max-tokens-default must be >= 1"),
    (("--max-tokens-default", "-1"), "--max-tokens-default must be >= 1"),
    (("--served-model-name", " "), "--served-model-name must not be empty"),
    (("--prefill-peer", "127.0.0.1:9", "--prefill-timeout", "nan"), "--prefill-timeout must be a number > 0"),
    (("--allowed-origins", "example.com"), "--allowed-origins: 'example.com' is not an origin"),
    (("--api-key", " sk-1"), r"--api-key \(or MESHLM_API_KEY\) must be printable ASCII"),
    (("--api-key", ""), r"--api-key \(or MESHLM_API_KEY\) must be printable ASCII"),
    (("--api-key", "sk-\u00e9"), r"--api-key \(or MESHLM_API_KEY\) must be printable ASCII"),
    (("--allowed-origins", "https://ok.example,javascript:alert(1)"), "is not an origin"),
    (("--chat-template", "chatml"), "neither a file nor a Jinja template"),
    (("--chat-template", "{% for m in messages %}{{ m.content }}"), r"--chat-template: line 1: Unexpected end"),
    (("--default-chat-template-kwargs", "{"), "--default-chat-template-kwargs is not JSON"),
    (("--default-chat-template-kwargs", "[1]"), "must be a JSON object"),
    (("--chat-template-args", '{"tools": []}'), "may not set tools"),
    # before the model loads, naming the parsers there are
    (("--tool-call-parser", "bogus"), "--tool-call-parser 'bogus': no such parser .*llama3_json"),
    (("--tool-call-parser", "../json_tools"), "--tool-call-parser '../json_tools': no such parser"),
    (("--client-timeout", "0"), r"--client-timeout must be in \(0, 86400\] seconds"),
    (("--client-timeout", "nan"), r"--client-timeout must be in \(0, 86400\] seconds"),
    (("--client-timeout", "inf"), r"--client-timeout must be in \(0, 86400\] seconds"),
    (("--role", "prefill", "--prefill-port", "8000", "--port", "8000"), "--prefill-port and --port are both 8000"),
    (("--pipeline-parallel", str(10**30)), "must be <= 1024"),  # was an OverflowError laying out the stages
    (("--kv-cache-dir", ""), "--kv-cache-dir must not be empty"),  # was the working directory
    (("--long-prefill-context", "-1"), r"--long-prefill-context must be >= 0 \(0: no limit\)"),
    # these ended in IndexError and OverflowError tracebacks as the cluster formed
    (("--control-addr", "garbage"), "--control-addr takes HOST:PORT, got 'garbage'"),
    (("--control-addr", "10.0.0.1:70000"), "--control-addr's port must be in 1..65535, got 70000"),
    (("--pipeline-parallel", "2", "--stage-port", "70000", "--control-addr", "10.0.0.1:52100"),
     "--stage-port must be in 1..65534"),
    (("--pipeline-parallel", "2", "--stage-port", "65535", "--control-addr", "10.0.0.1:52100"),
     r"rank 1's is --stage-port \+ 1\), got 65535"),
    (("--stage-port", "0", "--control-addr", "10.0.0.1:52100"), "--stage-port must be in 1..65535, got 0"),
    # a local cluster picks its own ports: these were ignored without a word
    (("--pipeline-parallel", "2", "--stage-port", "6000"), "--stage-port only applies with --hostfile"),
    (("--tensor-parallel", "2", "--control-port", "6000"), "--control-port only applies with --hostfile"),
    (("--context-parallel", "2", "--block-size", "15"), "context parallelism needs an even --block-size, got 15"),
    (("--speculative", "ngram", "--draft-model", "d"), "--draft-model is for --speculative draft, not ngram"),
    (("--speculative", "off", "--draft-model", "d"), "--draft-model is for --speculative draft, not off"),
])
def test_meaningless_values_are_refused_naming_the_flag(flags, words):
    with pytest.raises(ValueError, match=words):
        parse(*flags)


@pytest.mark.parametrize("text", ["1e400", "1e400GB", "1.2.3", "e", "."])
def test_a_size_past_a_float_or_not_a_number_is_an_argument_error(text):
    """Regression: '1e400' (infinity) raised OverflowError, which argparse does not catch: a traceback."""
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        cli.parse_bytes(text)
    assert cli.parse_bytes("1.5KiB") == 1536 and cli.parse_bytes("1e3") == 1000


def test_a_local_clusters_ranks_share_the_ssd_tiers_default_size(tmp_path):
    """Each rank of a local cluster kept 20 GB of blocks on the one disk they share: 80 GB for CP=4."""
    from meshlm.config import CacheConfig, ModelConfig
    from meshlm.executor.rank import RankSpec, build_rank
    from meshlm.model import demo
    from meshlm.model.loader import load_model

    assert parse().cache.ssd_cache_gb is None and CacheConfig().ssd_bytes() == 20 * 2**30
    assert CacheConfig().ssd_bytes(ranks_here=4) == 5 * 2**30
    assert parse("--ssd-cache-gb", "3").cache.ssd_bytes(ranks_here=4) == 3 * 2**30  # a rank's, as given
    model = demo.make_tiny(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1)
    cfg = ModelConfig(str(model))
    rank = build_rank(load_model(cfg), cfg, CacheConfig(cache_dir=str(tmp_path / "kv")), 2**20,
                      RankSpec("cp4", 2, ranks_here=4))
    assert rank.ssd.config.capacity_bytes == 5 * 2**30
