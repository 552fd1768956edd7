"""``HTML`` and ``display`` as ``sglang/utils.py`` imports them; used there only to render in notebooks."""


class HTML:
    def __init__(self, *args, **kwargs):
        self.data = args[0] if args else ""


def display(*args, **kwargs):
    return None
