"""The `precast` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tasks.demo import DEMO_FAMILIES, TINY_FAMILIES


def _quiet_prefect() -> None:
    # no network here or on most GPU nodes: never phone home
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # the stages log through standard logging; show those lines in Prefect's run logs too
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "tasks,flows,storage")


def _home() -> str | None:
    """For the commands that run the pipeline, where the user's home cannot hold per-user folders:
    an error for no home at all (Prefect reads it as it loads, whatever PREFECT_HOME says), else
    None. With a server set, nothing of Prefect's home is needed, so an unwritable one is replaced
    by a temporary folder (Prefect would warn that it cannot make it); without one, its database
    needs a real one (flows/server.py says so as it is made). The caches say so where they are
    written, naming what moves them."""
    from storage.store import home_problem

    if not (reason := home_problem()):
        return None
    if not os.path.isabs(os.path.expanduser("~")):
        return f"{reason}: set HOME to a folder this user can write in (Prefect, which the pipeline loads, needs one)"
    if os.environ.get("PREFECT_API_URL") and not os.environ.get("PREFECT_HOME"):
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="precast-prefect-home-")
        atexit.register(shutil.rmtree, folder, True)
        os.environ["PREFECT_HOME"] = folder
    return None


def storage_options(items: list[str]) -> dict:
    """`--option key=value` pairs as fsspec options (values parsed as YAML)."""
    import yaml

    return {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in items)}


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


def cmd_demo(args: argparse.Namespace) -> int:
    from configs.schema import QUICKSTART, load_config
    from tasks.demo import demo_settings, write_demo_inputs
    from tasks.runs.page import loss_text

    config = load_config(QUICKSTART, [*demo_settings(args.family), *args.set])  # --set model.path=… still decides
    write_demo_inputs(config, args.family, args.count)
    result = _run_pipeline(config)
    print(f"weights: {result['weights']}")
    for sample in result["samples"]:
        print(f"samples: {sample}")
    for video in result.get("sample_videos", []):
        print(f"sample videos: {video}")
    print(f"loss curve: {result['loss_curve']}")
    print(f"loss: {loss_text(result)}")
    if result["quarantined"]:
        print(f"quarantined at ingest: {result['quarantined']}, each with its reason in {result['ingest_report']}")
    print(f"the run's page: precast inspect {result['run']}")
    if "flow_run_url" in result:
        print(f"in the Prefect UI: {result['flow_run_url']}")
    return 0


def _run_pipeline(config) -> dict:
    """The pipeline's outputs, and its flow run: id, and the UI's page of it when a server is set."""
    from prefect.utilities.urls import url_for

    from flows.pipeline import pipeline
    from flows.server import ensure_server

    ensure_server()
    state = pipeline(config=config, return_state=True)
    result, run = state.result(), state.state_details.flow_run_id
    url = url_for("flow-run", obj_id=run)
    return {**result, "flow_run": str(run), **({"flow_run_url": url} if url else {})}


def cmd_run(args: argparse.Namespace) -> int:
    from configs.schema import load_config

    config = load_config(args.config, args.set)
    if args.direct:
        from tasks.runner import outputs, run_direct

        _print_result(outputs(run_direct(config)), args.json)
    else:
        _print_result(_run_pipeline(config), args.json)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from configs.schema import load_config
    from flows.pipeline import stage
    from flows.server import ensure_server

    config = load_config(args.config, args.set)
    ensure_server()
    _print_result(stage(name=args.name, config=config), args.json)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from configs.schema import load_config
    from flows.deploy import deploy
    from flows.server import require_server

    config = load_config(args.config, args.set)
    require_server("deploy registers deployments")
    names = deploy(config, nightly_cron=args.nightly, timezone=args.timezone,
                   home=args.home)
    for name in names:
        print(f"deployed: {name}")
    print(f"parameters: {args.config}" + (f" with {' '.join(args.set)}" if args.set else ""))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from configs.schema import load_config
    from flows.deploy import submit
    from flows.server import require_server

    if args.set and not args.config:
        raise ValueError("--set needs --config: it changes that config, not the deployed one")
    config = load_config(args.config, args.set) if args.config else None
    require_server("submit runs a deployment")
    result = submit(args.deployment, config, echo=lambda line: print(line, flush=True))
    if not result["failures"]:
        print(f"{args.deployment}: {result['state']}")
        return 0
    print(f"precast: {args.deployment} ended {result['state']} ({result['url']})", file=sys.stderr)
    for failure in result["failures"]:
        print(f"  {failure['stage']}: {failure['state']}: {failure['error']}", file=sys.stderr)
    return 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from configs.schema import StorageConfig
    from storage import layout
    from storage.store import Store
    from tasks.ingest.report import report_markdown

    options = storage_options(args.option)
    if f"/{layout.RUNS}/" in args.url:
        from tasks.runs.page import RunPage

        page = RunPage.at(args.url, options)
        if args.json:
            print(json.dumps({"run": page.url, "record": page.record, "lineage": page.lineage, "metrics": page.metrics,
                              "stages": page.stages}))
        else:
            print(page.text())
        return 0
    root, dataset_id = layout.parse_dataset(args.url)
    store = Store(StorageConfig(root=root, options=options))
    record = store.read_json(layout.dataset(dataset_id))
    report = store.read_json(layout.dataset_report(dataset_id))
    if args.json:
        print(json.dumps({"dataset": record, "report": report}))
    else:
        print(report_markdown(report))
        print(f"\n{len(record['shards'])} image shards under {store.url(layout.IMAGE_SHARDS)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from configs.schema import StorageConfig
    from storage.store import Store
    from storage.verify import report_text, verify_store

    options = storage_options(args.option)
    report = verify_store(Store(StorageConfig(root=args.root, options=options)), repair=args.repair)
    print(json.dumps(report) if args.json else report_text(report))
    return 0 if report["ok"] else 3


def cmd_sample(args: argparse.Namespace) -> int:
    from tasks.runs.sampling import check_output, read_picture, sample_run

    check_output(args.out)
    options = storage_options(args.option)
    if args.first_frame and args.reference:
        raise SystemExit("precast sample: --first-frame or --reference: a sample is drawn from one picture")
    setting, paths = ("--reference", args.reference) if args.reference else ("--first-frame", args.first_frame)
    pictures = [read_picture(path, options) for path in paths] if paths else None
    samples = sample_run(args.url, args.prompt, model_path=args.model, options=options, steps=args.steps,
                         guidance_scale=args.guidance_scale, seed=args.seed, device=args.device,
                         true_cfg_scale=args.true_cfg_scale, frames=args.frames, pictures=pictures, setting=setting)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    samples.save(args.out, args.fps or samples.fps)
    print(Path(args.out).resolve())
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.runs.export import export_adapter

    data = export_adapter(args.url, args.format, storage_options(args.option))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(data)
    print(Path(args.out).resolve())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from configs.schema import load_config
    from tasks.train.plan import parse_memory, plan_for, plan_text

    plan = plan_for(load_config(args.config, args.set), parse_memory(args.gpu_memory))
    print(plan_text(plan))
    return 0 if plan["choice"] is not None else 1


def cmd_tiny_models(args: argparse.Namespace) -> int:
    from tasks.demo import write_demo_models

    print(write_demo_models(args.dir, args.family, random_vae=args.random_vae))
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from tasks.demo import write_demo_dataset

    print(write_demo_dataset(args.dir, args.family, count=args.count, seed=args.seed))
    return 0


def cmd_certificates(args: argparse.Namespace) -> int:
    from flows.credentials import write_cluster_certificates

    folder = write_cluster_certificates(Path(args.dir), days=args.days)
    print(f"{folder.resolve()}: ca.pem, cert.pem, key.pem for every node and client (ca-key.pem stays here)\n"
          f"  dask scheduler --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem\n"
          f"  dask worker tls://SCHEDULER:8786 --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem\n"
          f"  execution: {{cluster: tls://SCHEDULER:8786, cluster_tls: {folder.resolve()}}}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="precast", description=__doc__)
    parser.add_argument("--threads", type=int, metavar="N",
                        help="CPU threads for this process and the processes it starts (torch, OpenMP); default: "
                             "OMP_NUM_THREADS, else every core. Give each of several precast processes on one node "
                             "its share: each taking every core slows them all many times over")
    parser.add_argument("--verbose", action="store_true",
                        help="also show third-party warnings known to be harmless, progress bars and INFO logs")
    commands = parser.add_subparsers(dest="command", required=True)
    add_pipeline_commands(commands)
    add_store_commands(commands)
    return parser


def with_config(sub: argparse.ArgumentParser, required: bool = True) -> None:
    if required:
        sub.add_argument("config", help="YAML config (see configs/)")
    sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set training.steps=10 (repeatable)")


def add_pipeline_commands(commands: argparse._SubParsersAction) -> None:
    """demo, run, stage, deploy, submit: the commands that run the pipeline or its stages."""
    from configs.schema import STAGES

    demo = commands.add_parser("demo", help="make tiny models and demo data, then run configs/quickstart.yaml")
    with_config(demo, required=False)
    demo.add_argument("--count", type=int, default=None,
                      help="demo pictures (default 1000), videos (default 600) or edit pairs (default 600) to "
                      "generate when missing")
    demo.add_argument("--family", choices=DEMO_FAMILIES, default=DEMO_FAMILIES[0],
                      help="the tiny models' family (each but the first in precast-demo/models/<family>; wan's: wan-ti2v)")
    demo.set_defaults(func=cmd_demo, pipeline=True)

    run = commands.add_parser("run", help="run the whole pipeline")
    with_config(run)
    run.add_argument("--json", action="store_true", help="print the output URLs as one JSON line")
    run.add_argument("--direct", action="store_true",
                     help="every stage in order in this process, without Prefect (debugging, profiling)")
    run.set_defaults(func=cmd_run, pipeline=True)

    stage = commands.add_parser("stage", help="run one stage alone, inputs taken from the store")
    stage.add_argument("name", choices=STAGES)
    with_config(stage)
    stage.add_argument("--json", action="store_true", help="print the stage's record as one JSON line")
    stage.set_defaults(func=cmd_stage, pipeline=True)

    deploy = commands.add_parser("deploy", help="register prefect.yaml's deployments with this config as parameters")
    with_config(deploy)
    deploy.add_argument("--nightly", metavar="CRON", help="the nightly schedule (default: prefect.yaml's, 0 2 * * *)")
    deploy.add_argument("--timezone", help="timezone of the nightly schedule (default: prefect.yaml's, UTC)")
    deploy.add_argument("--home", help="the checkout's path on the workers (default: $PRECAST_HOME, else this one)")
    deploy.set_defaults(func=cmd_deploy, pipeline=True)

    submit = commands.add_parser("submit", help="run a deployment and follow it; exit 1 with the failed stage's error")
    submit.add_argument("deployment", help="e.g. precast-pipeline/pipeline")
    submit.add_argument("--config", help="YAML config for this run (default: the one it was deployed with)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of --config (repeatable)")
    submit.set_defaults(func=cmd_submit, pipeline=True)


def add_store_commands(commands: argparse._SubParsersAction) -> None:
    """inspect, sample, export, verify, plan, tiny-models, demo-data: the commands that read what is
    stored, plan a run's memory, and make the demo's inputs."""
    inspect = commands.add_parser("inspect", help="show a training run's page or a dataset's ingest report")
    inspect.add_argument("url", help="a run (<root>/runs/<run_id>, as printed by run) or a dataset "
                                     "(<root>/datasets/<dataset_id>.json, as printed by ingest)")
    inspect.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                         help="fsspec storage option for the root, e.g. endpoint_url=http://… (repeatable)")
    inspect.add_argument("--json", action="store_true", help="print the run's records and metrics, or the dataset "
                                                             "record and report, as one JSON line")
    inspect.set_defaults(func=cmd_inspect)

    sample = commands.add_parser("sample", help="generate images with a trained run (its family's pipeline)")
    sample.add_argument("url", help="a run URL (<root>/runs/<id>) or its adapter/transformer URL")
    sample.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable: one image each)")
    sample.add_argument("--out", required=True, help="file to write, samples side by side: an .mp4 (H.264) or a "
                        ".webp is animated for video runs, any other picture format (.png) holds each sample's first frame")
    sample.add_argument("--frames", type=int, help="frames a sample (default: those of the clips the run trained "
                        "on, 1 for pictures)")
    sample.add_argument("--fps", type=float, help="frames a second of an .mp4 or .webp (default: the run's "
                        "training.samples.fps)")
    sample.add_argument("--first-frame", action="append", metavar="PICTURE",
                        help="a picture (path or URL) each clip starts from, one a --prompt in order: the family's "
                        "image-to-video pipeline draws the rest (Wan 2.2 TI2V; train with training.image_to_video)")
    sample.add_argument("--reference", action="append", metavar="PICTURE",
                        help="a picture (path or URL) each --prompt edits, in order: an edit family's pipeline draws "
                        "from it, sized as the run's training sized references where the pipeline can be told a size "
                        "(FLUX.1 Kontext; the Qwen-Image-Edit pipelines size it themselves)")
    sample.add_argument("--model", help="the run's model at this path or hub id (default: where the run read it)")
    sample.add_argument("--steps", type=int, default=20)
    sample.add_argument("--guidance-scale", type=float, default=4.5,
                        help="classifier-free guidance, or a guidance-distilled transformer's guidance input")
    sample.add_argument("--true-cfg-scale", type=float, default=1.0,
                        help="classifier-free guidance on top of a guidance-distilled transformer's input (1: none)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--device", default="auto")
    sample.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for the URL (repeatable)")
    sample.set_defaults(func=cmd_sample)

    export = commands.add_parser("export", help="write a run's LoRA in the layout another program loads")
    export.add_argument("url", help="a run URL (<root>/runs/<id>) or its adapter URL")
    export.add_argument("--format", required=True, choices=["comfyui", "diffusers"],
                        help="comfyui: one .safetensors for ComfyUI's LoRA loader; diffusers: the file the family's "
                             "pipeline's load_lora_weights reads (where the pipeline has a LoRA loader)")
    export.add_argument("--out", required=True, help="file to write")
    export.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for the URL (repeatable)")
    export.set_defaults(func=cmd_export)

    verify = commands.add_parser("verify", help="check every committed artifact; list partial and orphaned objects")
    verify.add_argument("root", help="the store root URL")
    verify.add_argument("--repair", action="store_true", help="remove partial and orphaned objects (nothing else)")
    verify.add_argument("--json", action="store_true", help="print the report as one JSON line")
    verify.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for the root (repeatable)")
    verify.set_defaults(func=cmd_verify)

    plan = commands.add_parser("plan", help="the memory a config's training step needs, by setting, and the "
                                            "settings that fit a card (no weights, no GPU: the model's config.json)")
    with_config(plan)
    plan.add_argument("--gpu-memory", default="24GiB", help="the card's memory: 24GiB, 80GB, 48G, … (default 24GiB)")
    plan.set_defaults(func=cmd_plan)

    tiny = commands.add_parser("tiny-models", help="write the demo's tiny models in the hub layout")
    tiny.add_argument("dir")
    tiny.add_argument("--family", choices=TINY_FAMILIES, default=TINY_FAMILIES[0], help="the tiny models' family")
    tiny.add_argument("--random-vae", action="store_true",
                      help="a random VAE (with the published latent factors), for checks of the loading path; by "
                           "default it is set by hand to give back each 8 x 8 block's colour")
    tiny.set_defaults(func=cmd_tiny_models)

    data = commands.add_parser("demo-data", help="write a deterministic generated dataset of captioned pictures, or "
                                                 "of captioned videos (with hostile files) for a video family")
    data.add_argument("dir")
    data.add_argument("--family", choices=DEMO_FAMILIES, default=DEMO_FAMILIES[0], help="whose demo data")
    data.add_argument("--count", type=int, default=48)
    data.add_argument("--seed", type=int, default=0)
    data.set_defaults(func=cmd_demo_data)

    certificates = commands.add_parser("certificates", help="write a Dask cluster's TLS CA and member certificate "
                                                            "(mutual TLS for execution.cluster)")
    certificates.add_argument("dir", help="folder for ca.pem, ca-key.pem, cert.pem, key.pem (an existing CA is kept)")
    certificates.add_argument("--days", type=int, default=365, help="how long the certificates are valid")
    certificates.set_defaults(func=cmd_certificates)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _quiet_prefect()
    args = build_parser().parse_args(argv)
    if getattr(args, "pipeline", False) and (refused := _home()):
        print(f"precast: {refused}", file=sys.stderr)
        return 1
    if args.verbose:  # workers and training processes started from here read it too
        os.environ["PRECAST_VERBOSE"] = "1"
    if args.threads:  # before torch loads, here and in every process started from here
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ and (others := other_precast_processes()):
        print(f"precast: {others} other precast process{'es' * (others > 1)} on this node, each using every core "
              f"unless told otherwise; give each --threads N (N × processes ≤ {os.cpu_count()} cores)",
              file=sys.stderr)
    from tasks.log_filter import quiet_known_noise

    quiet_known_noise()  # before any library that makes the noise loads
    # precast's own progress at INFO; other libraries' only from WARNING on, unless --verbose
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    for name in ("tasks", "flows", "storage"):
        logging.getLogger(name).setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"precast: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if refused := api_refusal(error):
            print(f"precast: {refused}", file=sys.stderr)
            return 1
        raise


def other_precast_processes() -> int:
    """Other `precast` commands running on this node (their CPU threads compete with this one's)."""
    import psutil

    def is_precast(process: psutil.Process) -> bool:
        try:
            command = process.cmdline()
        except (psutil.Error, OSError):
            return False
        return any(Path(part).name == "precast" or part == "flows.cli" for part in command[:3])

    me = os.getpid()
    return sum(1 for process in psutil.process_iter() if process.pid != me and is_precast(process))


def api_refusal(error: BaseException) -> str | None:
    """What to tell a user whose Prefect server refused the credentials (or their absence), else None."""
    import httpx

    while error is not None and not isinstance(error, httpx.HTTPStatusError):
        error = error.__cause__ or error.__context__
    if error is None or error.response.status_code not in (401, 403):
        return None
    from prefect.settings import get_current_settings

    sent = "sent an auth string it does not accept" if get_current_settings().api.auth_string else "sent no auth string"
    return (f"the Prefect server at {error.request.url.scheme}://{error.request.url.netloc.decode()} refused the "
            f"request ({error.response.status_code} {error.response.reason_phrase}): this client {sent}. Set "
            "PREFECT_API_AUTH_STRING (the setting api.auth_string) to the server's user:password "
            "(infra/local-stack.sh: the file auth-string in its STACK_DIR)")


if __name__ == "__main__":
    sys.exit(main())
