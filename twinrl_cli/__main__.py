"""``python -m twinrl_cli``: the ``twin`` command line."""

from twinrl_cli import main

if __name__ == "__main__":
    main()
