"""``python -m fastvideo.bench geneval ...`` (fastvideo.bench.cli)."""
from fastvideo.bench.cli import main

if __name__ == "__main__":
    main()
