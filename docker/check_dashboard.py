"""Run every query of a Grafana dashboard against a live Prometheus and report, panel by panel, whether the
query is valid PromQL and returns data.

    python docker/check_dashboard.py [--prometheus http://127.0.0.1:9090] [--dashboard PATH] [--range 5m]

Grafana's variables are replaced the way Grafana would for a dashboard range of --range: $__rate_interval and
$__interval by 1m (four scrape intervals of 15 s; the single-host config scrapes every 5 s), $__range by the
range itself. Exit status: 1 if any query is refused (bad PromQL or an unknown function), 2 if a query answered
with no series while --require-data is given, else 0.
"""

import argparse
import json
import sys
from pathlib import Path

import httpx

DEFAULT_DASHBOARD = Path(__file__).resolve().parent / "grafana" / "dashboards" / "dflash.json"


def panel_queries(board: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every target, rows' nested panels included, in dashboard order."""
    found = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(board.get("panels", []))
    return found


def with_grafana_variables(expr: str, dashboard_range: str) -> str:
    return (expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
            .replace("$__range", dashboard_range))


def run_query(client: httpx.Client, prometheus: str, expr: str) -> tuple[str, int]:
    """("ok", series) or ("error: ...", 0)."""
    response = client.get(f"{prometheus}/api/v1/query", params={"query": expr})
    body = response.json()
    if body.get("status") != "success":
        return f"error: {body.get('errorType')}: {body.get('error')}", 0
    return "ok", len(body["data"]["result"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", type=Path, default=DEFAULT_DASHBOARD)
    parser.add_argument("--range", default="5m", help="the dashboard range that $__range stands for")
    parser.add_argument("--require-data", action="store_true", help="a query with no series fails the check")
    args = parser.parse_args(argv)
    board = json.loads(args.dashboard.read_text())
    refused = empty = 0
    with httpx.Client(timeout=30) as client:
        for title, expr in panel_queries(board):
            verdict, series = run_query(client, args.prometheus, with_grafana_variables(expr, args.range))
            refused += verdict != "ok"
            empty += verdict == "ok" and series == 0
            print(f"{verdict:>5} {series:3d} series  {title}: {expr}")
    print(f"{len(panel_queries(board))} queries: {refused} refused, {empty} without data", file=sys.stderr)
    return 1 if refused else 2 if empty and args.require_data else 0


if __name__ == "__main__":
    sys.exit(main())
