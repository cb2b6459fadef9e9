"""The local stack's components start in order and each says its line in that order."""

from sssd.cli.stack import Line, Stack


class Started:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def start(self) -> str:
        self.log.append(f"start {self.name}")
        return f"[{self.name}] serving"

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")


def test_a_line_is_said_in_its_place_among_the_components_and_stops_nothing():
    log: list[str] = []
    said: list[str] = []
    stack = Stack([Started("1/5", log), Line("drafting", "[2/5] drafting in process"),
                   Started("3/5", log)], say=said.append)
    stack.start()
    assert said == ["[1/5] serving", "[2/5] drafting in process", "[3/5] serving"]
    stack.stop()
    assert log == ["start 1/5", "start 3/5", "stop 3/5", "stop 1/5"]
