"""``moeplan profile``: record a local MoE checkpoint's routing on prompts as a v1 trace."""

from __future__ import annotations

import typer

from planner.cli.app import app, console, refuse_empty_paths


@app.command("profile")
def profile(
    model: str = typer.Option(..., "--model", help="Local Hugging Face checkpoint directory."),
    prompts: str = typer.Option(
        ..., "--prompts", help="Prompts: JSONL ({'text', 'id'?, 'domain'?}) or one per line."
    ),
    out: str = typer.Option(..., "--out", help="Trace directory to write part-*.parquet into."),
    max_prompts: int | None = typer.Option(None, "--max-prompts", help="Use the first N prompts."),
    max_length: int = typer.Option(512, "--max-length", help="Truncate prompts to T tokens."),
    batch_size: int = typer.Option(8, "--batch-size", help="Prompts per forward pass."),
    device: str | None = typer.Option(
        None, "--device", help="cpu or cuda (default: cuda when available)."
    ),
    dtype: str | None = typer.Option(
        None, "--dtype", help="float32, bfloat16 or float16 (default: bf16 on cuda, fp32 on cpu)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted run in --out."),
    save_embeddings: bool = typer.Option(
        False,
        "--save-embeddings",
        help="Also save the input embeddings as embeddings.safetensors, in the run's dtype.",
    ),
) -> None:
    """Record every prompt token's top-k experts and gate weights at every MoE layer."""
    # Imported here: torch and transformers load only when this command runs.
    from planner.profile import ProfileConfig, profile_model, render_profile_summary

    refuse_empty_paths(model=model, prompts=prompts, out=out)
    config = ProfileConfig(
        max_prompts=max_prompts,
        max_length=max_length,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        resume=resume,
        save_embeddings=save_embeddings,
    )
    result = profile_model(model, prompts, out, config, progress=True)
    console.print(render_profile_summary(result))
