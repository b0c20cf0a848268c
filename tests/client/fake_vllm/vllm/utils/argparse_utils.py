"""Stand-in for tests."""

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    pass
