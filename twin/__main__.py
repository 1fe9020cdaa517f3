"""``python -m twin``: the ``twin`` command line."""

from twin.cli import main

if __name__ == "__main__":
    main()
