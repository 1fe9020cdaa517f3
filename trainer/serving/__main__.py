"""``python -m trainer.serving MODEL [options]``: ``twin serve`` without the CLI."""

from trainer.serving.cli import run_cli

if __name__ == "__main__":
    run_cli()
