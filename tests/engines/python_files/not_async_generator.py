"""generate is a coroutine function, not an async generator function."""


async def generate(request: dict[str, object]) -> str:
    return "no yield"
