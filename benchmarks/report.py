"""Render BENCHMARKS.md from one ``run_all.py`` output folder and the hand-written prose.

    .venv/bin/python benchmarks/run_all.py --out bench-out
    .venv/bin/python benchmarks/report.py bench-out            # the report on stdout
    .venv/bin/python benchmarks/report.py bench-out --write    # BENCHMARKS.md and the plots

Generated from the folder: the header (the run's command, date, commit, wall time, machine,
versions, load), the summary table (``summary.py``: each row from that run's ``results.json``)
and, per section, its command, time, exit status and load average (``results.json``) and its
latest tables (``<section>.md``, as run_all wrote them). Written by hand, in
``benchmarks/report_template.md``: the introduction, the notes under the summary, and per
section what it measures and why and how to read it. Every section of the run is rendered, in
the template's order, then the run's own order: one the template does not describe (a new
benchmark added to run_all) gets a generic heading and its tables. ``--write`` also copies the
run's plots (``<out>/*.png``) next to this script, where the report links them.

Limits: the numbers are those of the folder's run only; nothing is merged from other runs.
A section whose script failed shows its failure (run_all keeps the output's tail).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from summary import summary_rows  # noqa: E402

TEMPLATE = HERE / "report_template.md"
MARKER = re.compile(r"^<!-- (intro|summary|reproduce|section ([\w.-]+)|latest) -->\s*$")
HEADING = re.compile(r"^(#{1,6}) ")


@dataclass
class Section:
    """One section's hand-written prose: its heading, what it measures, how to read it."""

    heading: str
    what: str
    read: str


@dataclass
class Template:
    intro: str
    summary: str
    sections: dict[str, Section]
    reproduce: str = ""


def parse_template(text: str) -> Template:
    """Split the template at its ``<!-- ... -->`` markers (see the template's own comment).

    Text before the first marker (the template's explanatory comment) is dropped. A section's
    first non-empty line is its heading (``## ...``); the ``latest`` marker separates "what it
    measures" from "how to read it". Raises ``ValueError`` on a section without a heading or
    a ``latest`` marker outside a section."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        m = MARKER.match(line)
        if m:
            if m.group(1) == "latest":
                if not blocks or not blocks[-1][0].startswith("section "):
                    raise ValueError("a <!-- latest --> marker outside a section block")
                blocks[-1][1].append("\0latest")
            else:
                blocks.append((m.group(1), []))
        elif blocks:
            blocks[-1][1].append(line)
    intro = summary = reproduce = ""
    sections: dict[str, Section] = {}
    for kind, lines in blocks:
        body = "\n".join(lines)
        if kind == "intro":
            intro = body.strip()
        elif kind == "summary":
            summary = body.strip()
        elif kind == "reproduce":
            reproduce = body.strip()
        else:
            name = kind.split(" ", 1)[1]
            what, _, read = body.partition("\0latest")
            what = what.strip()
            heading, _, what = what.partition("\n")
            if not HEADING.match(heading):
                raise ValueError(f"section {name}: its first line must be a heading, not {heading!r}")
            sections[name] = Section(heading.strip(), what.strip(), read.strip())
    return Template(intro, summary, sections, reproduce)


def load_run(out: Path) -> tuple[dict[str, Any], list[str]]:
    """``results.json`` of a run_all folder and its section names: the run's, then any other
    ``<section>.md`` in the folder (a section run into the same folder separately)."""
    results = json.loads((out / "results.json").read_text())
    names = list(results.get("sections", {}))
    names += sorted(p.stem for p in out.glob("*.md") if p.stem not in names)
    return results, names


def relative(command: str) -> str:
    """A command with the checkout's absolute paths made relative (it runs from the repo root) and
    run_all's temporary folder (the demo's ``--workdir``) named as such."""
    return re.sub(r"\S*/hwr-run-all-[^/\s]+/", "<run_all tmpdir>/", command.replace(f"{REPO}/", ""))


def machine_line(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    peers = ", ".join(f"{k} {v}" for k, v in m.get("peers", {}).items())
    return (f"{m.get('nproc', '?')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gib', '?')} GiB RAM, "
            f"kernel {m.get('kernel', '?')}; Python {m.get('python', '?')}, torch {m.get('torch', '?')}, "
            f"safetensors {m.get('safetensors', '?')}" + (f", {peers}" if peers else ""))


def short_machine(results: dict[str, Any]) -> str:
    m = results.get("machine", {})
    return (f"{m.get('nproc', '?')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gib', '?')} GiB, "
            f"torch {m.get('torch', '?')}, safetensors {m.get('safetensors', '?')}, "
            f"the run of {results.get('date', '?')}")


def header(results: dict[str, Any], names: list[str]) -> str:
    entries = results.get("sections", {})
    failed = [n for n, e in entries.items() if e.get("rc") != 0]
    wall = results.get("wall_s")
    load = results.get("loadavg_start") or [0.0]
    end = results.get("loadavg_end")
    size = f"{results.get('size_mib', '?')} MiB bf16 artifacts" + (", smoke repeats" if results.get("quick") else "")
    lines = [f"- **Command:** `{relative(results.get('command', '?'))}` ({size})",
             f"- **Date:** {results.get('date', '?')} (UTC), commit {results.get('commit') or 'unknown'}"
             + (f"; wall time {wall:,.1f} s" if wall is not None else "; the run did not finish")
             + f"; {len(entries) - len(failed)}/{len(entries)} sections ok"
             + (f" (failed: {', '.join(failed)})" if failed else ""),
             f"- **Machine and versions:** {machine_line(results)}",
             f"- **Load:** load average {load[0]:.2f} at the start"
             + (f", {end[0]:.2f} at the end" if end else "") + "; per section in its command line below",
             "- Raw output of the run: `<out>/<section>.log`, `<section>.md`, `results.json` (not committed)."]
    if results.get("quick"):
        lines.insert(0, "> **Placeholder from a `--quick` smoke run** (64 MiB artifacts, few repeats): the "
                        "numbers show the layout, not the product's speed. Regenerate with a default run.\n")
    return "\n".join(lines)


def demote(md: str, level: int = 4) -> str:
    """Every heading of a section's tables at ``level`` (they sit under the section's own)."""
    return "\n".join(HEADING.sub("#" * level + " ", line) for line in md.splitlines())


def section_tables(out: Path, name: str) -> str:
    """``<section>.md`` without run_all's own heading and command line (rendered apart)."""
    path = out / f"{name}.md"
    if not path.exists():
        return "(no tables: the section wrote no output)"
    lines = path.read_text().splitlines()
    if lines and lines[0].strip() == f"## {name}":
        lines = lines[1:]
        while lines and not lines[0].strip():
            lines = lines[1:]
        if lines and lines[0].startswith("`"):  # the command line: rendered from results.json
            lines = lines[1:]
    # Each line a script prints outside a table is a statement of its own (a goal, a total):
    # a blank line between two of them keeps markdown from running them into one paragraph.
    spaced: list[str] = []
    for line in lines:
        if spaced and line.strip() and spaced[-1].strip() and not (line.startswith("|") and spaced[-1].startswith("|")):
            spaced.append("")
        spaced.append(line)
    return demote("\n".join(spaced).strip())


def command_line(name: str, entry: dict[str, Any] | None) -> str:
    if not entry:
        return "**Command:** not recorded in results.json (run separately into this folder)."
    argv = relative(entry.get("command", "?"))
    argv = re.sub(r" --json-out \S+", "", argv)  # run_all's own plumbing
    before, after = entry.get("loadavg_before") or [0.0], entry.get("loadavg_after") or [0.0]
    return (f"**Command:** `{argv}` ({entry.get('seconds', '?')} s, rc {entry.get('rc', '?')}; load average "
            f"before {before[0]:.2f}, after {after[0]:.2f})")


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a markdown heading (lower case, punctuation dropped, - for spaces)."""
    text = HEADING.sub("", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def summary_table(results: dict[str, Any], anchors: dict[str, str]) -> str:
    rows = summary_rows(results)
    if not rows:
        return "(no section of this run yields a summary row)"
    head = ["what is measured", "hwr", "best peer in the same run", "peer / hwr", "limit", "section"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r.cells(anchors)) + " |" for r in rows]
    return "\n".join(out)


def generic_heading(name: str) -> str:
    return f"## {name} (`benchmarks/{name}.py`)"


PLOT = re.compile(r"^!\[([^]]*)\]\(benchmarks/([\w.-]+\.png)\)[ \t]*$", re.MULTILINE)


def plots(text: str, out: Path) -> str:
    """Keep a plot link only when the run drew that plot (``<out>/<name>.png``; --write copies it)."""
    def keep(m: re.Match[str]) -> str:
        return m.group(0) if (out / m.group(2)).exists() else f"(no plot in this run: {m.group(2)} was not drawn)"

    return PLOT.sub(keep, text)


def render(out: Path, template: Template) -> str:
    results, names = load_run(out)
    ordered = [n for n in template.sections if n in names] + [n for n in names if n not in template.sections]
    entries = results.get("sections", {})
    anchors = {n: github_anchor(template.sections[n].heading if n in template.sections else generic_heading(n))
               for n in ordered}
    parts = [template.intro, "## The run", header(results, names), "## Summary", summary_table(results, anchors),
             template.summary, template.reproduce]
    for name in ordered:
        prose = template.sections.get(name)
        if prose is None:
            parts += [generic_heading(name),
                      "What it measures: see the script's docstring (no prose for it in "
                      "benchmarks/report_template.md yet)."]
        else:
            parts += [prose.heading, plots(prose.what, out)]
        parts += [command_line(name, entries.get(name)) + f"  \n**Machine:** {short_machine(results)} (versions of "
                  "everything: [the run](#the-run))", "### Latest tables", section_tables(out, name)]
        if prose is not None and prose.read:
            parts.append(plots(prose.read, out))
    missing = [n for n in template.sections if n not in names]
    if missing:
        parts.append(f"Sections described in the template but not in this run: {', '.join(missing)}.")
    return "\n\n".join(p.strip() for p in parts if p.strip()) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="a run_all.py output folder (results.json, <section>.md)")
    ap.add_argument("--template", type=Path, default=TEMPLATE)
    ap.add_argument("--write", action="store_true", help="write BENCHMARKS.md and copy <out>/*.png to benchmarks/")
    ap.add_argument("-o", "--output", type=Path, help="write the report to this file (plots not copied)")
    args = ap.parse_args(argv)
    if not (args.out / "results.json").exists():
        ap.error(f"{args.out}/results.json not found: run benchmarks/run_all.py --out {args.out} first")
    text = render(args.out, parse_template(args.template.read_text()))
    if args.output:
        args.output.write_text(text)
        return 0
    if not args.write:
        sys.stdout.write(text)
        return 0
    (REPO / "BENCHMARKS.md").write_text(text)
    for png in sorted(args.out.glob("*.png")):
        shutil.copyfile(png, HERE / png.name)
        print(f"copied {png} -> {HERE / png.name}")
    print(f"wrote {REPO / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
