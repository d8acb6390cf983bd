# A cell that ends in a bare expression shows it in a notebook, as HTML.
# ruff: noqa: B018
# %% [markdown]
# # The launcher from a notebook
#
# A percent-format script: open it in Jupyter (jupytext), VS Code or PyCharm and run it cell by
# cell, or run it whole with `python docs/tutorial.py`. The tests run it too
# (tests/test_tutorial.py), so every cell here works. It needs the `plot` extra for the PNGs.
#
# It loads a recipe, estimates its memory (with the picture), plans its layout, trains the tiny
# CPU model on this machine with the local backend, follows the job and plots its metrics.
# Jobs and their metrics live under `$LAUNCHER_HOME` (default `~/.launcher`).

# %%
import os
from pathlib import Path

from launcher import api

REPO = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd()
OUT = Path(os.environ.get("TUTORIAL_OUT", "tutorial-output"))
OUT.mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## Load a recipe
# A recipe is a validated value. `--set` overrides are dotted keys; here one process trains the
# tiny Llama for four steps, so the whole tutorial is quick. In a notebook the recipe shows
# as a table.

# %%
recipe = api.load(
    REPO / "recipes" / "tiny-cpu.yaml",
    set_options=[
        "training.steps=4",
        "training.global_batch_size=2",
        "parallel.tensor=1",
        "cluster.nproc_per_node=1",
        "cluster.max_restarts=0",
        "checkpoint.every_steps=0",
    ],
)
recipe

# %% [markdown]
# ## Estimate its memory
# The estimate says whether the job fits, with a stacked bar per pipeline stage against the
# GPU's memory and the 80% line; `plot` draws the same as a PNG. The tiny CPU model needs
# megabytes, so we also look at a real 128k-token recipe.

# %%
memory = api.estimate(recipe)
print(memory.headline())
big = api.estimate(REPO / "recipes" / "llama70b-128k.yaml")
big.plot(OUT / "memory.png")
big

# %% [markdown]
# ## Plan the layout
# The planner ranks every layout that fits by predicted throughput; `plans.best` is the first.

# %%
plans = api.plan(REPO / "recipes" / "llama70b-128k.yaml", top=1000)
print(f"{len(plans)} layouts fit; best: {plans.best.describe()}, {plans.best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU")
plans.plot(OUT / "plans.png")
plans[:5]

# %% [markdown]
# ## Train on this machine
# `submit` checks the memory, builds the job and starts it on the local backend; `wait` follows
# its log until it ends. The same job on SageMaker is `backend="sagemaker"`.

# %%
submission = api.submit(recipe, backend="local")
job = submission.job
final = job.wait(on_line=print, poll_s=0.5)
print(final.state)
final

# %% [markdown]
# ## Its metrics
# `job.metrics()` returns every logged step, from any backend (`launcher metrics NAME` on the
# command line); `plot_metrics` draws loss, tokens/s, MFU and memory against step.

# %%
history = job.metrics()
print(f"{len(history)} steps, last loss {history.last['loss']:.3f}")
job.plot_metrics(OUT / "metrics.png")
history
