"""`Recipe`: a validated recipe resolved against the catalogs. The root of the data flow."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import yaml
from pydantic import PrivateAttr, ValidationError, model_validator

from launcher.catalog import ModelArch
from launcher.catalog.engines import STOP_EXIT_S, capabilities
from launcher.contract.config import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    SYNTHETIC_DOCUMENT_SEPARATOR,
    ConfigError,
    JobConfig,
    checkpoint_bytes_per_param,
)
from launcher.contract.config import FORMAT as RESOLVED_FORMAT
from launcher.contract.layout import Layout
from launcher.display import html
from launcher.errors import Problem, RecipeError, UsageError
from launcher.recipe import rules
from launcher.recipe.hardware import Hardware, resolve_hardware
from launcher.recipe.loader import RawRecipe, apply_overrides, load_raw
from launcher.recipe.messages import problems_from_validation
from launcher.recipe.references import fill_from_manifest, init_from_problems, resolve_model
from launcher.recipe.schema import DATA_PREPARE_KEYS, RecipeSpec

SETTLED_AT_RESOLVE = (
    "parallel.data_shard",
    "parallel.cp_attention",
    "parallel.grad_accumulation",
    "checkpoint.every_minutes",
)
"""The recipe keys whose `auto` the launcher settles before a job exists (launcher/resolve.py).
The other autos of the schema are run-time choices: data.format (how `launcher data prepare`
reads each raw file) and checkpoint.resume (the newest checkpoint found when the job starts)."""


class JobIdentity(NamedTuple):
    """The job a resolved config is for: the MLflow run's tags name it."""

    name: str
    backend: str
    lineage: str


class RuleViolations(ValueError):
    """Raised inside validation to carry cross-field problems out through pydantic."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


# bf16 keeps 8 significant bits: values within 2^-8 (0.39%) of each other round alike. Above this
# beta2 an exp_avg_sq update of (1 - beta2) x its size is lost to rounding.
BF16_STATE_MAX_BETA2 = 0.99


class Recipe(RecipeSpec):
    """A recipe that passed every rule. Build it with `Recipe.load(path)`; it never changes.

    A recipe is a value: it knows nothing of its consumers. `launcher.api.estimate(recipe)` and
    `launcher.api.plan(recipe)` estimate its memory and plan its layout.

    `arch`, `hardware` and `layout` are the recipe resolved against the catalogs: the model's
    exact shapes, the GPUs it runs on, and the parallel layout with `data_shard` filled in.
    What the recipe leaves to the launcher (`unsettled`) is settled by `launcher.resolve.resolve`,
    whose concrete recipe alone has a `resolved()` job config.
    """

    _arch: ModelArch = PrivateAttr()
    _hardware: Hardware = PrivateAttr()
    _layout: Layout = PrivateAttr()
    _source: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _apply_rules(self) -> Recipe:
        arch, problems = resolve_model(self.model)
        hardware, hardware_problems = resolve_hardware(self)
        problems += hardware_problems + rules.sagemaker_problems(self) + rules.slurm_problems(self)
        problems += rules.training_problems(self) + rules.tracking_problems(self)
        if arch is not None and hardware is not None:
            world_size = hardware.world_size
            where = (
                f"{self.cluster.instance_count} x {hardware.instance_key}"
                if hardware.instance_key != "local"
                else "this machine"
            )
            layout, layout_problems = rules.resolve_layout(self, world_size, where)
            problems += layout_problems + rules.hardware_problems(self, arch, hardware)
            problems += rules.architecture_problems(self, arch) or init_from_problems(
                self.model, arch, self.training.seq_len
            )
            # Without a complete layout, still check the degrees themselves (a TP degree that
            # splits no head count is wrong on any cluster); only the batch rule needs data_shard.
            par = self.parallel
            probe = layout or Layout(
                tensor=par.tensor,
                context=par.context,
                pipeline=par.pipeline,
                data_replicate=par.data_replicate,
                expert=par.expert,
                virtual_stages=par.virtual_stages,
                pipeline_layers=None if par.pipeline_layers is None else tuple(par.pipeline_layers),
            )
            found = rules.layout_problems(
                probe,
                arch,
                seq_len=self.training.seq_len,
                global_batch_size=self.training.global_batch_size,
                micro_batch_size=self.training.micro_batch_size,
                gpus_per_node=hardware.procs_per_node,
                schedule=par.pipeline_schedule,
            )
            # The batch and expert rules read data_shard, which only a complete layout has.
            unresolved = ("training.global_batch_size", "parallel.expert")
            problems += found if layout else [p for p in found if p.path not in unresolved]
            problems += rules.attention_problems(self, arch, probe)
            if layout is not None:
                self._layout = layout
            self._arch, self._hardware = arch, hardware
        if problems:
            raise RuleViolations(problems)
        return self

    # --- construction -------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path, overrides: Mapping[str, Any] | None = None, *, origin: str = "overrides") -> Recipe:
        """Read a YAML recipe, apply `extends` and dotted-path overrides, and validate it.

        Raises RecipeError with one Problem per thing wrong, each pointing at its file and line.
        """
        raw = load_raw(path)
        if overrides:
            raw = apply_overrides(raw, overrides, origin=origin)
        recipe = cls._from_raw(raw)
        recipe._source = Path(path)
        return recipe

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Recipe:
        raw = RawRecipe(dict(data))
        if overrides:
            raw = apply_overrides(raw, overrides, origin="overrides")
        return cls._from_raw(raw)

    @classmethod
    def _from_raw(cls, raw: RawRecipe) -> Recipe:
        try:
            return cls.model_validate(fill_from_manifest(raw.data))
        except ValidationError as err:
            located = problems_from_validation(err, raw.data, RecipeSpec)
            for error in err.errors():
                violation = (error.get("ctx") or {}).get("error")
                if isinstance(violation, RuleViolations):
                    located += [(_key_path(p.path), p) for p in violation.problems]
            problems = [Problem(p.path, p.message, raw.origin(path)) for path, p in located]
            raise RecipeError(problems) from None

    def with_changes(self, overrides: Mapping[str, Any]) -> Recipe:
        """A new, validated recipe with dotted-path changes, e.g. {"parallel.context": 16}."""
        recipe = type(self).from_dict(self.to_dict(), overrides)
        recipe._source = self._source
        return recipe

    # --- what the recipe resolves to -------------------------------------------------------

    @property
    def arch(self) -> ModelArch:
        return self._arch

    @property
    def hardware(self) -> Hardware:
        return self._hardware

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def source(self) -> Path | None:
        return self._source

    @property
    def world_size(self) -> int:
        return self._layout.world_size

    @property
    def model_name(self) -> str:
        ref = self.model
        if isinstance(ref, str):
            return ref
        return (
            getattr(ref, "base", None)
            or Path(ref.hf_config or f"{ref.init_from}/config.json").parent.name
            or "hf-model"
        )

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self._layout.data_parallel)

    def grad_accumulation(self) -> str:
        """The accumulation mode the job runs (parallel.grad_accumulation made concrete).

        One micro-batch has nothing to accumulate: sync_each. Under pipeline parallelism blocks
        stay gathered between micro-batches whatever the mode (pipeline.py), so sync_last runs as
        sync_last_gathered; sync_each still reduce-scatters every micro-batch's gradients. "auto"
        stays, for the estimator to pick (launcher/resolve.py).
        """
        if self.grad_accum_steps == 1:
            return "sync_each"
        mode = self.parallel.grad_accumulation
        if self._layout.pipeline > 1 and mode == "sync_last":
            return "sync_last_gathered"
        return mode

    @property
    def unsettled(self) -> tuple[str, ...]:
        """The keys of SETTLED_AT_RESOLVE that still say auto: () for a concrete recipe."""
        return tuple(key for key in SETTLED_AT_RESOLVE if self.value_at(key) == "auto")

    def value_at(self, key: str) -> Any:
        """The value of a dotted recipe key, e.g. value_at("checkpoint.every_minutes")."""
        section, field = key.split(".")
        return getattr(getattr(self, section), field)

    @property
    def tokens_per_step(self) -> int:
        return self.training.global_batch_size * self.training.seq_len

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint's size: master weights and AdamW's moments (contract.checkpoint_bytes_per_param)."""
        return self.arch.num_params() * checkpoint_bytes_per_param(self.training.optimizer.state_dtype)

    @property
    def warnings(self) -> list[str]:
        notes = []
        if self.training.seq_len > self.arch.max_context:
            notes.append(
                f"training.seq_len: {self.training.seq_len} is beyond {self.model_name}'s trained context of {self.arch.max_context} tokens"
            )
        if self.training.optimizer.warmup_steps >= self.training.steps:
            notes.append(
                f"training.optimizer.warmup_steps: {self.training.optimizer.warmup_steps} >= steps {self.training.steps}; the run never leaves warmup"
            )
        optimizer = self.training.optimizer
        if optimizer.state_dtype == "bf16" and optimizer.betas[1] > BF16_STATE_MAX_BETA2:
            notes.append(
                f"training.optimizer.state_dtype: bf16 with betas[1] {optimizer.betas[1]}: the second moment's "
                f"per-step change ({1 - optimizer.betas[1]:.2%}) is below bf16's resolution (0.39%), so small "
                f"gradients stop moving it; use betas[1] <= {BF16_STATE_MAX_BETA2} or state_dtype fp32"
            )
        return notes

    @property
    def placeholders(self) -> list[str]:
        """Values still as the documentation wrote them, which submit refuses: `validate` says so,
        the other verbs (plan, estimate, show) need no account and do not."""
        runs_as_role = capabilities(self.cluster.backend).runs_as_role
        if runs_as_role and (placeholder := rules.placeholder_role(self.sagemaker.role_arn)):
            return [f"{placeholder}; submit refuses it"]
        return []

    # --- output ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The user-level recipe (no `extends`); `Recipe.from_dict(r.to_dict()) == r`."""
        return self.model_dump(mode="json", exclude={"extends"})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def resolved(
        self,
        *,
        checkpoint_dir: str | None = None,
        output_dir: str | None = None,
        model_dir: str | None = None,
        job: JobIdentity | None = None,
    ) -> JobConfig:
        """The job config that the entrypoints read (`to_dict()` is resolved.json): every name
        replaced by numbers. Backends pass where checkpoints and outputs live on their cluster, and
        where a relative checkpoint.export_hf goes when not under the outputs (`model_dir`); a job
        spec passes the job it is for (`job`), which the trackers name.

        Only a concrete recipe has one: a recipe never calls the estimator, so what it leaves to
        the launcher (`unsettled`) is settled first by `launcher.resolve.resolve(recipe)`.
        """
        if self.unsettled:
            says = "says" if len(self.unsettled) == 1 else "say"
            raise UsageError(
                f"{self.name}: {', '.join(self.unsettled)} still {says} auto; the job config is that of the "
                "concrete recipe, launcher.resolve.resolve(recipe).concrete"
            )
        try:
            return JobConfig.from_dict(self._job_config_data(checkpoint_dir, output_dir, model_dir, job))
        except ConfigError as error:  # the recipe's rules mirror the contract's; still one line, never a traceback
            raise UsageError(f"{self.name}: the entrypoints would refuse this job config: {error}") from None

    def _job_config_data(
        self,
        checkpoint_dir: str | None,
        output_dir: str | None,
        model_dir: str | None = None,
        job: JobIdentity | None = None,
    ) -> dict[str, Any]:
        accelerator = self.hardware.accelerator
        layout = self.layout
        return {
            "format": RESOLVED_FORMAT,
            "name": self.name,
            "model": {
                "name": self.model_name,
                **self.arch.model_dump(mode="json"),
                "init_from": getattr(self.model, "init_from", None),
            },
            "training": self.training.model_dump(mode="json"),
            "precision": self.precision.model_dump(mode="json"),
            "parallel": {
                **layout.as_dict(),
                "pipeline_schedule": self.parallel.pipeline_schedule,
                "activation_checkpointing": self.parallel.activation_checkpointing,
                "cp_attention": self.parallel.cp_attention,
                "world_size": layout.world_size,
                "grad_accum_steps": self.grad_accum_steps,
                "grad_accumulation": self.grad_accumulation(),
                "reduce_dtype": self.parallel.reduce_dtype,
                "tp_saved_inputs": self.parallel.tp_saved_inputs,
            },
            "data": {
                **self.data.model_dump(mode="json", exclude=set(DATA_PREPARE_KEYS)),
                "document_separator": self.document_separator,
            },
            "checkpoint": {
                **self.checkpoint.model_dump(mode="json"),
                "dir": checkpoint_dir or self.checkpoint.dir,
                "export_hf": self._export_directory(model_dir),
            },
            "runtime": {
                "device": self.cluster.device,
                "nnodes": self.cluster.instance_count,
                "nproc_per_node": self.hardware.procs_per_node,
                "accelerator": self.hardware.accelerator_key,
                "peak_flops": {
                    "bf16": accelerator.peak_bf16_tflops * 1e12 if accelerator.peak_bf16_tflops else None,
                    "fp8": accelerator.peak_fp8_tflops * 1e12 if accelerator.peak_fp8_tflops else None,
                },
                "output_dir": output_dir,
                "stop_budget_s": float(self.stop_grace_s - STOP_EXIT_S),
                "collective_timeout_s": float(self.cluster.collective_timeout or DEFAULT_COLLECTIVE_TIMEOUT_S),
            },
            "tracking": self._tracking_data(job),
        }

    def _tracking_data(self, job: JobIdentity | None) -> dict[str, Any]:
        """tracking for the job: MLflow's experiment defaults to the recipe, its run to the job.

        The job's name and lineage are written only for MLflow, which tags its run with them: they
        differ for every job, and resolved.json is in the code bundle, which an unchanged job reuses."""
        mlflow = self.tracking.mlflow
        job = job if mlflow is not None else None
        return {
            "tensorboard": self.tracking.tensorboard,
            "mlflow": None
            if mlflow is None
            else {
                "uri": mlflow.uri,
                "experiment": mlflow.experiment or self.name,
                "run_name": mlflow.run_name or (job.name if job else self.name),
            },
            "job_name": job.name if job else None,
            "backend": job.backend if job else None,
            "lineage": job.lineage if job else None,
        }

    @property
    def stop_grace_s(self) -> int:
        """Seconds from the engine's SIGTERM to its SIGKILL for this job (launcher.catalog.engines)."""
        return capabilities(self.cluster.backend).stop_grace(self.cluster.stop_grace)

    def _export_directory(self, model_dir: str | None) -> str | None:
        """checkpoint.export_hf for the job: true is "hf", false is no export; a relative one is
        under `model_dir` when the backend has one, else (the entrypoints) under the output directory."""
        export = "hf" if self.checkpoint.export_hf is True else (self.checkpoint.export_hf or None)
        if export is None or model_dir is None or PurePosixPath(export).is_absolute():
            return export
        return str(PurePosixPath(model_dir) / export)

    @property
    def document_separator(self) -> int | None:
        """The token that ends a document: data.document_separator, or synthetic data's own."""
        data = self.data
        if data.document_separator is None and data.source == "synthetic":
            return SYNTHETIC_DOCUMENT_SEPARATOR
        return data.document_separator

    def run_sections(self) -> dict[str, Any]:
        """Where the job runs, which `launcher show` prints beside the resolved job config: the
        cluster, sagemaker, slurm and k8s sections, defaults filled in."""
        recipe = self.to_dict()
        return {key: recipe[key] for key in ("cluster", "sagemaker", "slurm", "k8s")}

    def summary(self) -> dict[str, Any]:
        """Derived values for `launcher show`: what the recipe resolves to, in one place."""
        hw = self.hardware
        return {
            "model": self.model_name,
            "parameters": self.arch.num_params(),
            "instance": f"{self.cluster.instance_count} x {hw.instance_key}",
            "accelerator": hw.accelerator_key,
            "world_size": self.world_size,
            "layout": str(self.layout),
            "data_shard": self.layout.data_shard,
            "data_parallel": self.layout.data_parallel,
            "grad_accum_steps": self.grad_accum_steps,
            "tokens_per_step": self.tokens_per_step,
        }

    def summary_line(self) -> str:
        fp8 = ", fp8" if self.precision.fp8 else ""
        hw = self.hardware
        return (
            f"{self.model_name}, {self.training.seq_len} tokens{fp8}, {self.layout} "
            f"on {self.cluster.instance_count} x {hw.instance_key} ({self.world_size} x {hw.accelerator_key})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recipe) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Recipe({self.name!r}, {self.model_name}, seq {self.training.seq_len}, {self.layout} on {self.cluster.instance_count}x{self.hardware.instance_key})"

    __str__ = __repr__

    def _repr_html_(self) -> str:
        t, hw = self.training, self.hardware
        rows = [
            ("model", f"{self.model_name} ({self.arch.num_params() / 1e9:.3g} B parameters)"),
            ("sequence", f"{t.seq_len:,} tokens"),
            (
                "batch",
                f"global {t.global_batch_size}, micro {t.micro_batch_size}, {self.grad_accum_steps} accumulation steps",
            ),
            ("tokens per step", f"{self.tokens_per_step:,}"),
            ("steps", f"{t.steps:,}"),
            ("precision", self.precision.dtype + (", fp8" if self.precision.fp8 else "")),
            ("layout", str(self.layout)),
            ("cluster", f"{self.cluster.instance_count} x {hw.instance_key}: {self.world_size} x {hw.accelerator_key}"),
            ("backend", self.cluster.backend),
        ]
        if self.source is not None:
            rows.append(("file", str(self.source)))
        rows += [("warning", w) for w in self.warnings]
        return html.table(rows, title=f"Recipe {self.name}")


def _key_path(dotted: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in dotted.split(".")) if dotted else ()
