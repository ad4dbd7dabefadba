"""JUnit XML from test records: one ``<testsuite>`` per shard, merged into ``<testsuites>``.

Why cpq writes its own instead of reusing pytest's ``--junitxml``: the shard's file must
exist whether or not the user asked for one, land under a name the merge can find, and the
merged file must be built from the same records the exactly-once check reads (one source
of truth). The shape is the common JUnit subset every CI reader accepts, with pytest's
own words where pytest's ``--junitxml`` has them: a failure's ``message`` is the exception
line, an error's ``failed on setup with "..."``, a skip is ``type="pytest.skip"`` with its
reason and location, an xfail ``type="pytest.xfail"`` with its reason.

Every file names its run (``<testsuites name="cpq run ID">`` and a ``cpq_run_id`` property
on each suite): a CI that publishes a results directory must be able to tell this run's
file from one an earlier run left. A test's ``time`` is its own time
(:attr:`~cpq.fanout.manifest.TestRecord.own_s`): the wait for a group to start is the pool
spec's spawn, given apart as the ``cpq_spawn_wait_s`` property of the test that waited.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

from cpq.fanout.manifest import Manifest, TestRecord

_TAGS = {"failed": "failure", "error": "error", "skipped": "skipped"}


def _split(test_id: str) -> tuple[str, str]:
    """JUnit's classname and name from a pytest node id."""
    path, sep, name = test_id.partition("::")
    if not sep:
        return "", test_id
    module = path.removesuffix(".py").replace("/", ".")
    *classes, leaf = name.split("::")
    return ".".join([module, *classes]), leaf


def _clean(text: str) -> str:
    """Text XML 1.0 can hold (no control characters but tab and newlines)."""
    return "".join(c if c in "\t\n\r" or ord(c) >= 32 else f"\\x{ord(c):02x}" for c in text)


def _message(record: TestRecord) -> str:
    """The ``message`` pytest's own JUnit writes (``_pytest.junitxml``): an error says in
    which phase it happened and quotes the exception line."""
    if record.outcome == "error" and record.when in ("setup", "teardown"):
        return f'failed on {record.when} with "{record.message}"'
    return record.message


def testcase(test_id: str, record: TestRecord) -> ET.Element:
    classname, name = _split(test_id)
    case = ET.Element(
        "testcase", classname=_clean(classname), name=_clean(name), time=f"{record.own_s:.3f}"
    )
    if record.spawn_wait_s:
        properties = ET.SubElement(case, "properties")
        wait = f"{record.spawn_wait_s:.3f}"
        ET.SubElement(properties, "property", name="cpq_spawn_wait_s", value=wait)
    tag = _TAGS.get(record.outcome)
    if tag is not None:
        child = ET.SubElement(case, tag, message=_clean(_message(record)))
        if record.kind:
            child.set("type", record.kind)
        child.text = _clean(record.details) or None
    if record.retries:
        ET.SubElement(case, "system-err").text = f"[CPQ-RETRY] {record.retries} retr(y/ies)"
    return case


def testsuite(manifest: Manifest) -> ET.Element:
    records = [(i, manifest.tests[i]) for i in manifest.selected if i in manifest.tests]
    counts = {k: sum(r.outcome == k for _, r in records) for k in ("failed", "error", "skipped")}
    suite = ET.Element(
        "testsuite",
        name=f"cpq shard {manifest.index}/{manifest.count}",
        tests=str(len(records)),
        failures=str(counts["failed"]),
        errors=str(counts["error"]),
        skipped=str(counts["skipped"]),
        time=f"{manifest.wall_s:.3f}",
        hostname=manifest.hostname,
    )
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("cpq_run_id", manifest.run_id),
        ("cpq_shard", f"{manifest.index}/{manifest.count}"),
        ("cpq_restart_count", str(manifest.restart_count)),
        ("cpq_spawn_wait_s", f"{manifest.spawn_wait_s:.3f}"),
    ):
        ET.SubElement(properties, "property", name=name, value=_clean(value))
    for test_id, record in records:
        suite.append(testcase(test_id, record))
    return suite


def write(path: Path, manifests: Sequence[Manifest]) -> None:
    """One file of ``manifests`` (of one run, which it names), written atomically."""
    suites = [testsuite(m) for m in manifests]
    runs = sorted({m.run_id for m in manifests})
    root = ET.Element("testsuites", name=_clean(f"cpq run {', '.join(runs) or '?'}"))
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(s.get(key, "0")) for s in suites)))
    root.extend(suites)
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a fresh file: the user's umask, not a leftover's mode
    ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
    tmp.replace(path)
