"""The benchmark's report: the ceiling, the common offered rate and their outputs, on figures."""

from __future__ import annotations

import json
from pathlib import Path

from devtools.bench import report
from devtools.bench.report import LoadPoint, VariantResult


def _result(key: str, per_s: float, cpu_s_per_1k: float = 0.1) -> VariantResult:
    return VariantResult(
        variant=key,
        records=1000,
        records_per_s=per_s,
        latency_ms={"p50": 1.0, "p95": 2.0, "p99": 3.0},
        cpu_s_per_1k=cpu_s_per_1k,
        peak_rss_mib=80.0,
        cpu_of="variant process",
    )


def _point(rate: float, p99: float) -> LoadPoint:
    return LoadPoint(rate, rate, {"p50": p99 / 2, "p95": p99 * 0.9, "p99": p99})


RESULTS = {
    "sync": _result("sync", 300.0),
    "worker": _result("worker", 5000.0),
    "worker_tuned": _result("worker_tuned", 6000.0),
    "triton": _result("triton", 9000.0),
    "triton_batched": _result("triton_batched", 20000.0),
    "kafka": _result("kafka", 12000.0),
}


def test_common_rate_is_half_the_tuned_peak_else_the_slowest_unless_given() -> None:
    """Half the tuned worker's 6,000/s; without it half the slowest (defaults 5,000/s)."""
    rate, how = report.common_rate(RESULTS, None) or (0.0, "")
    assert rate == 3000.0
    assert report.VARIANTS["worker_tuned"] in how
    untuned = {k: v for k, v in RESULTS.items() if k != "worker_tuned"}
    rate, how = report.common_rate(untuned, None) or (0.0, "")
    assert rate == 2500.0 and report.VARIANTS["worker"] in how
    assert report.common_rate(RESULTS, 700.0) == (700.0, "given (--common-rate)")
    assert report.common_rate({"sync": RESULTS["sync"]}, None) is None


def test_sum_of_parts_adds_kafka_alone_and_each_triton_alone_p99() -> None:
    """Kafka alone p99 40 + Triton alone p99 5 (unbatched) or 7 (batched)."""
    points = {
        "worker_tuned": _point(1000, 30.0),
        "triton": _point(1000, 5.0),
        "triton_batched": _point(1000, 7.0),
        "kafka": _point(1000, 40.0),
    }
    common = report.at_common_rate(1000.0, "given", points)
    assert common.sum_of_parts_p99_ms == {"triton_batched": 47.0, "triton": 45.0}
    without_kafka = report.at_common_rate(1000.0, "given", {"triton": _point(1000, 5.0)})
    assert without_kafka.sum_of_parts_p99_ms == {}


def test_the_ceiling_is_the_slower_of_kafka_alone_and_triton_alone_batched() -> None:
    """Kafka alone (12,000/s) binds: tuned 6,000/s is 0.5 of it (fails), 10,000/s passes."""
    assert report.ceiling(RESULTS) == ("kafka", 12000.0)
    targets = {t.name: t for t in report.ratios(RESULTS)}
    ratio = targets["worker, tuned / the ceiling, min(Kafka alone, Triton alone batched)"]
    assert (ratio.value, ratio.passed) == (0.5, False)
    faster = {**RESULTS, "worker_tuned": _result("worker_tuned", 10000.0)}
    ratio = next(t for t in report.ratios(faster) if "the ceiling" in t.name)
    assert ratio.value == 10000.0 / 12000.0 and ratio.passed
    assert report.ceiling({k: v for k, v in RESULTS.items() if k != "triton_batched"}) is None


def test_baselines_and_cpu_per_record_against_kafka_alone_of_the_same_client() -> None:
    """naive 3,000/s: defaults 5,000/s is 1.67 (>= 1.5); CPU is held to the same client's Kafka."""
    results = {
        **RESULTS,
        "naive": _result("naive", 3000.0),
        "kafka": _result("kafka", 12000.0, cpu_s_per_1k=0.05),
        "worker": _result("worker", 5000.0, cpu_s_per_1k=0.1),
        "worker_confluent": _result("worker_confluent", 5000.0, cpu_s_per_1k=0.06),
        "kafka_confluent": _result("kafka_confluent", 30000.0, cpu_s_per_1k=0.05),
    }
    targets = {t.name: t for t in report.ratios(results)}
    naive = targets["worker, defaults / naive async"]
    assert (round(naive.value, 2), naive.target, naive.passed) == (1.67, ">= 1.5", True)
    cpu = targets["worker, defaults: CPU per record / Kafka alone's"]
    assert (cpu.value, cpu.passed) == (2.0, False)
    cpu = targets["worker, defaults, librdkafka: CPU per record / Kafka alone, librdkafka's"]
    assert (round(cpu.value, 2), cpu.passed) == (1.2, True)
    client = targets["worker, defaults: CPU per record, librdkafka / aiokafka"]
    assert (client.value, client.passed) == (0.6, False)


def test_tuned_librdkafka_against_aiokafka_and_its_own_ceiling() -> None:
    """Tuned 6,000/s on aiokafka, 9,600/s on librdkafka: 1.6 (>= 1.5); its ceiling 12,000."""
    results = {
        **RESULTS,
        "worker_tuned_confluent": _result("worker_tuned_confluent", 9600.0, cpu_s_per_1k=0.04),
        "kafka_confluent": _result("kafka_confluent", 30000.0),
    }
    targets = {t.name: t for t in report.ratios(results)}
    rate = targets["worker, tuned: records/s, librdkafka / aiokafka"]
    assert (rate.value, rate.passed) == (1.6, True)
    cpu = targets["worker, tuned: CPU per record, librdkafka / aiokafka"]
    assert (round(cpu.value, 2), cpu.passed) == (0.4, True)
    name = (
        "worker, tuned, librdkafka / the ceiling, "
        "min(Kafka alone on librdkafka, Triton alone batched)"
    )
    assert (targets[name].value, targets[name].passed) == (9600.0 / 20000.0, False)


def test_p99_at_the_common_rate_is_held_to_the_sum_of_the_parts_plus_10_ms() -> None:
    """Kafka alone 40 + Triton batched 7 + 10 = 57: the tuned worker's 50 passes, 60 fails."""
    points = {
        "worker_tuned": _point(3000, 50.0),
        "worker_tuned_confluent": _point(3000, 60.0),
        "triton_batched": _point(3000, 7.0),
        "kafka": _point(3000, 40.0),
        "kafka_confluent": _point(3000, 40.0),
    }
    common = report.at_common_rate(3000.0, "half the tuned peak", points)
    targets = {t.name: t for t in report.ratios(RESULTS, common)}
    aiokafka = targets["worker, tuned: p99 at 3,000/s (ms)"]
    assert (aiokafka.value, aiokafka.passed) == (50.0, True)
    assert aiokafka.target.endswith("= 57.0")
    librdkafka = targets["worker, tuned, librdkafka: p99 at 3,000/s (ms)"]
    assert (librdkafka.value, librdkafka.passed) == (60.0, False)


def test_markdown_and_json_show_the_ceiling_and_the_common_rate(tmp_path: Path) -> None:
    """The Markdown has the ceiling line and one row per variant plus the sums; the JSON too."""
    points = {
        k: _point(2500, p99) for k, p99 in (("worker", 50.0), ("triton", 4.0), ("kafka", 30.0))
    }
    common = report.at_common_rate(2500.0, "half the slowest peak", points)
    meta = {"model": "mlp", "records": 1000, "sync_records": 100, "partitions": 4, "machine": "m"}
    text = report.markdown(RESULTS, [], report.ratios(RESULTS), meta, common)
    assert (
        "The ceiling: min(Kafka alone 12,000/s and Triton alone, batched 20,000/s) "
        "= 12,000 rows/s; the worker, tuned 6,000/s is 0.50 of it." in text
    )
    assert "Latency at one common offered rate, 2,500/s (half the slowest peak)" in text
    assert "| (c) worker, defaults | 2,500 | 2,500 | 25.0 | 45.0 | 50.0 |" in text
    assert "| sum of parts: Kafka alone p99 + Triton alone p99 | - | - | - | - | 34.0 |" in text
    assert "| (e') ceiling 1: Triton alone, batched | 20,000 |" in text
    report.write_json(tmp_path / "bench.json", {"at_common_rate": common})
    written = json.loads((tmp_path / "bench.json").read_text())["at_common_rate"]
    assert written["offered_per_s"] == 2500.0
    assert written["points"]["worker"]["latency_ms"]["p99"] == 50.0
    assert written["sum_of_parts_p99_ms"] == {"triton": 34.0}


def test_plot_adds_a_panel_for_the_common_rate(tmp_path: Path) -> None:
    """With the common-rate measurements the plot has three panels, so it is wider."""
    from matplotlib import image

    common = report.at_common_rate(2500.0, "given", {"kafka": _point(2500, 30.0)})
    assert report.plot(tmp_path / "two.png", RESULTS, [])
    assert report.plot(tmp_path / "three.png", RESULTS, [], None, common)
    two, three = image.imread(tmp_path / "two.png"), image.imread(tmp_path / "three.png")
    assert two.shape[0] == three.shape[0]
    assert three.shape[1] == round(two.shape[1] * 3 / 2)


def test_each_mode_of_the_tuned_worker_is_held_to_the_tuned_worker_on_its_client() -> None:
    """exactly_once 4,800/s of 6,000 is 0.8 (passes); on librdkafka 7,000 of 10,000 is 0.7
    (fails); key ordering the same bound; audit 5,400 of 6,000 is 0.9 (passes), 5,300 fails."""
    results = {
        **RESULTS,
        "worker_tuned_confluent": _result("worker_tuned_confluent", 10000.0),
        "worker_eos": _result("worker_eos", 4800.0),
        "worker_eos_confluent": _result("worker_eos_confluent", 7000.0),
        "worker_key": _result("worker_key", 4700.0),
        "worker_key_confluent": _result("worker_key_confluent", 9000.0),
        "worker_audit": _result("worker_audit", 5400.0),
        "worker_audit_confluent": _result("worker_audit_confluent", 8900.0),
    }
    targets = {t.name: t for t in report.ratios(results)}
    got = {
        name: (round(t.value, 4), t.target, t.passed)
        for name, t in targets.items()
        if "records/s, " in name and "librdkafka / aiokafka" not in name
    }
    assert got == {
        "worker, tuned: records/s, exactly_once / at_least_once": (0.8, ">= 0.8", True),
        "worker, tuned, librdkafka: records/s, exactly_once / at_least_once": (
            0.7,
            ">= 0.8",
            False,
        ),
        "worker, tuned: records/s, key ordering / unordered": (0.7833, ">= 0.8", False),
        "worker, tuned, librdkafka: records/s, key ordering / unordered": (0.9, ">= 0.8", True),
        "worker, tuned: records/s, audit on / off": (0.9, ">= 0.9", True),
        "worker, tuned, librdkafka: records/s, audit on / off": (0.89, ">= 0.9", False),
    }


def test_a_mode_without_its_tuned_worker_has_no_target() -> None:
    """worker_eos measured alone (--variants worker_eos): nothing to divide by, no target."""
    alone = {"worker_eos": _result("worker_eos", 4800.0)}
    assert report.mode_ratios(alone) == []
    assert report.mode_ratios({**alone, "worker_tuned": _result("worker_tuned", 0.0)}) == []


def test_the_tuned_workers_are_held_to_ten_times_the_quixstreams_peer() -> None:
    """quix 600/s: tuned 6,000/s is 10.0 (passes), on librdkafka 5,900/s 9.83 (fails)."""
    results = {
        **RESULTS,
        "quix": _result("quix", 600.0),
        "worker_tuned_confluent": _result("worker_tuned_confluent", 5900.0),
    }
    targets = {t.name: t for t in report.ratios(results)}
    aiokafka = targets["worker, tuned / quixstreams, Triton per message: records/s"]
    assert (aiokafka.value, aiokafka.target, aiokafka.passed) == (10.0, ">= 10", True)
    librdkafka = targets["worker, tuned, librdkafka / quixstreams, Triton per message: records/s"]
    assert (round(librdkafka.value, 2), librdkafka.passed) == (9.83, False)
    assert report.peer_ratios(RESULTS) == []  # no quix measured
    assert report.peer_ratios({"quix": _result("quix", 600.0)}) == []  # no tuned worker


def test_markdown_rows_of_the_new_variants_and_how_keys_were_chosen() -> None:
    """Each new variant has its row; the key-ordering note says how many keys (or none)."""
    results = {
        **RESULTS,
        "quix": _result("quix", 600.0),
        "worker_key": _result("worker_key", 5000.0),
        "worker_eos_confluent": _result("worker_eos_confluent", 4000.0),
    }
    meta = {"model": "mlp", "records": 1000, "sync_records": 100, "partitions": 4, "machine": "m"}
    text = report.markdown(results, [], report.ratios(results), {**meta, "ordering_keys": 1000})
    assert "| (b2) quixstreams, Triton per message | 600 |" in text
    assert "| (d3) worker, tuned, key ordering | 5,000 |" in text
    assert "| (d2') worker, tuned, exactly_once, librdkafka | 4,000 |" in text
    assert "requests keyed over 1,000 keys" in text
    text = report.markdown(results, [], [], {**meta, "ordering_keys": 0})
    assert "each request keyed by its own id" in text
    assert "Key ordering" not in report.markdown(RESULTS, [], [], meta)
