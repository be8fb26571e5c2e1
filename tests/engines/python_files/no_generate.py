"""Defines no generate function."""


async def answer(request: dict[str, object]) -> None:
    return None
