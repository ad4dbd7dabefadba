"""JUnit XML from test records: one ``<testsuite>`` per shard, merged into ``<testsuites>``.

Why cpq writes its own instead of reusing pytest's ``--junitxml``: the shard's file must
exist whether or not the user asked for one, land under a name the merge can find, and the
merged file must be built from the same records the exactly-once check reads (one source
of truth). The shape is the common JUnit subset every CI reader accepts.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
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


def testcase(test_id: str, record: TestRecord) -> ET.Element:
    classname, name = _split(test_id)
    case = ET.Element(
        "testcase", classname=_clean(classname), name=_clean(name), time=f"{record.wall_s:.3f}"
    )
    tag = _TAGS.get(record.outcome)
    if tag is not None:
        child = ET.SubElement(case, tag, message=_clean(record.message))
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
    for test_id, record in records:
        suite.append(testcase(test_id, record))
    return suite


def write(path: Path, manifests: Iterable[Manifest]) -> None:
    root = ET.Element("testsuites", name="cpq")
    for manifest in manifests:
        root.append(testsuite(manifest))
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
    tmp.replace(path)
