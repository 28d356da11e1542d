/* libFuzzer target: `pw_token_event` (app/phasewatch/proxy/csrc/scan.c), which the Python path calls on
 * every whole one-line event of an exactly counted stream (stream.py `_token_chunk`).
 * Checked: a taken event's counts are counts, and its usage span lies inside it, starts at
 * the key (or the comma before it) and ends after the object's closing brace.
 */
#include <stdint.h>
#include <string.h>

#include "scan.h"

#define CHECK(cond) do { if (!(cond)) __builtin_trap(); } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int64_t completion, prompt;
    size_t from, to;
    if (!pw_token_event((const char *)data, size, &completion, &prompt, &from, &to)) return 0;
    CHECK(completion >= 0 && completion <= PW_MAX_TOKEN_COUNT);
    CHECK(prompt >= -1 && prompt <= PW_MAX_TOKEN_COUNT);
    CHECK(from < to && to <= size);
    CHECK(data[to - 1] == '}');
    CHECK(data[from] == ',' || data[from] == '"');
    return 0;
}
