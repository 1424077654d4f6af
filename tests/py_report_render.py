"""Renders `fp4moe profile --report` in headless Chromium: the screenshot
must not be blank, and the DOM must hold the figures of the run's JSON
(phase times, delta table, model, verdicts), formatted as the text output
formats them."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser

sys.path.insert(0, os.path.join(os.environ.get("FM_TEST_DATA", "tests/data"), "prof"))
import profcheck  # noqa: E402


class Cells(HTMLParser):
    """Collects text of elements that carry data-* attributes, and a few
    structural facts."""

    def __init__(self):
        super().__init__()
        self.stack = []
        self.cells = {}      # (batch, row/col) -> text of td.ms / model cells
        self.delta = {}      # (from, to, row, col) -> text
        self.verdicts = {}   # batch -> text
        self.svgs = []       # ids / classes of svg elements
        self.points = set()  # batches placed on the roofline
        self.segs = set()    # (batch, row) of stacked-bar segments
        self.table = None
        self.external = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for k in ("src", "href"):
            if k in a:
                self.external.append((tag, a[k]))
        if tag == "svg":
            self.svgs.append(a.get("id") or a.get("class"))
        if tag == "circle" and a.get("class") == "point":
            self.points.add(int(a["data-batch"]))
        if tag == "rect" and a.get("class") == "seg":
            self.segs.add((int(a["data-batch"]), a["data-row"]))
        if tag == "table" and a.get("class") == "delta":
            self.table = (int(a["data-from"]), int(a["data-to"]))
        key = None
        if tag == "td" and "data-batch" in a and "data-metric" in a:
            key = ("cell", int(a["data-batch"]), "telemetry:" + a["data-metric"])
        elif tag == "td" and "data-batch" in a and ("data-row" in a or "data-col" in a):
            key = ("cell", int(a["data-batch"]), a.get("data-row") or a.get("data-col"))
        elif tag == "td" and "data-col" in a and self.table:
            key = ("delta",) + self.table + (a["data-row"], a["data-col"])
        elif tag == "li" and a.get("id", "").startswith("verdict-"):
            key = ("verdict", int(a["id"][8:]))
        self.stack.append([tag, key, ""])

    def handle_endtag(self, tag):
        while self.stack:
            t, key, text = self.stack.pop()
            if key:
                text = " ".join(text.split())
                if key[0] == "cell":
                    self.cells[key[1:]] = text
                elif key[0] == "delta":
                    self.delta[key[1:]] = text
                else:
                    self.verdicts[key[1]] = text
            if self.stack:
                self.stack[-1][2] += text
            if t == tag:
                break
        if tag == "table":
            self.table = None

    def handle_data(self, data):
        if self.stack:
            self.stack[-1][2] += data


def ms(j, row, v):
    return "fused" if row in j["fused_phases"] and v == 0.0 else f"{v:.3f}"


def main():
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not chrome:
        profcheck.skip("chromium not installed")
    profcheck.cli()
    with tempfile.TemporaryDirectory() as d:
        args = ["--preset", "tiny-deepseek", "--batch", "4,16", "--bandwidth", "4", "--peak-gflops", "30",
                "--steps", "40", "--warmup", "1", "--tile-n", "32", "--period-ms", "5"]
        _, paths = profcheck.run_profile(args, d)
        j = json.load(open(paths["json"]))
        html = open(paths["html"], encoding="utf-8").read()
        profile_dir = os.path.join(d, "chrome-profile")
        base = [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-dev-shm-usage", "--force-device-scale-factor=1",
                f"--user-data-dir={profile_dir}", "--window-size=1000,1400"]
        url = "file://" + paths["html"]
        shot = os.path.join(d, "shot.png")
        # one browser start for both: the DOM comes on stdout
        dom = subprocess.run(base + [f"--screenshot={shot}", "--dump-dom", url], capture_output=True, text=True,
                             timeout=120)
        assert dom.returncode == 0 and os.path.exists(shot), dom.stderr[-2000:]
        assert "</html>" in dom.stdout, dom.stdout[-500:]

        # --- the screenshot is not blank: many non-white pixels, several colours
        w, h, bpp, px = profcheck.png_pixels(shot)
        assert (w, h) == (1000, 1400), (w, h)
        nonwhite, colours = 0, set()
        for i in range(0, len(px), bpp * 7):  # every 7th pixel is plenty
            rgb = (px[i], px[i + 1], px[i + 2])
            if rgb != (255, 255, 255):
                nonwhite += 1
                colours.add(rgb)
        sampled = len(px) // (bpp * 7)
        assert nonwhite > 0.02 * sampled, f"screenshot nearly blank: {nonwhite}/{sampled} non-white"
        # the phase colours of the stacked bars are on screen (#e15759 gate_up, #4e79a7 routing)
        assert (0xe1, 0x57, 0x59) in colours and (0x4e, 0x79, 0xa7) in colours, len(colours)

        # --- the DOM Chromium built holds the run's figures
        p = Cells()
        p.feed(dom.stdout)
        assert not p.external, p.external
        assert "<script" not in html
        assert "roofline" in p.svgs and "bars" in p.svgs and "telemetry" in p.svgs, p.svgs
        batches = [b["batch"] for b in j["batches"]]
        assert p.points == set(batches), p.points
        for b in j["batches"]:
            B = b["batch"]
            for row, v in b["phases_ms"].items():
                assert p.cells[(B, row)] == ms(j, row, v), (B, row, p.cells.get((B, row)), v)
                if v > 0 and row != "total":
                    assert (B, row) in p.segs, (B, row)
            m = b["model"]
            assert p.cells[(B, "pct_of_floor")] == f"{m['pct_of_floor']:.1f}"
            assert p.cells[(B, "floor_ms")] == f"{m['floor_ms']:.3f}"
            bd = m["route_read_bound_ms"]
            assert p.cells[(B, "bound_ms")] == ("-" if bd is None else f"{bd:.3f}")
            assert p.cells[(B, "step_ms")] == f"{b['step_ms']:.3f}"
            assert p.cells[(B, "active_expected")] == f"{m['active_expected']:.1f}"
            assert p.cells[(B, "active_observed")] == f"{m['active_observed']:.1f}"
            assert p.cells[(B, "tile_fill")] == f"{100 * m['tile_fill']:.1f} % of 32"
            assert p.verdicts[B] == f"batch {B}: {b['verdict_text']}", p.verdicts[B]
            t = b["telemetry"]
            for metric, mean in t["mean"].items():
                key = (B, "telemetry:" + metric)
                if mean is None:
                    assert key not in p.cells, key
                else:
                    assert p.cells[key] == f"{mean:.1f} / {t['max'][metric]:.1f}", (key, p.cells[key])
        dl = j["deltas"][0]
        for row, v in dl["rows"].items():
            assert p.delta[(dl["from"], dl["to"], row, "delta")] == f"{v['delta_ms']:+.3f}"
            want = "n/a" if v["share_pct"] is None else f"{v['share_pct']:.1f} %"
            assert p.delta[(dl["from"], dl["to"], row, "share")] == want
    print(f"py_report_render: screenshot {nonwhite}/{sampled} sampled pixels non-white, "
          f"{len(colours)} colours; DOM figures match the JSON")


if __name__ == "__main__":
    main()
