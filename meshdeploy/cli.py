"""Console entry point; the engine's CLI lives in meshdeploy.deploy.cli."""


def main(argv=None):
    from meshdeploy.deploy.cli import main as engine_main

    return engine_main(argv)
