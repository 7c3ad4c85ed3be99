#!/usr/bin/env bash
# Debian's Chromium and its chromedriver, for the browser test of report.html
# (tests/commands/test_report_browser.py: headless, driven by selenium through /usr/bin/chromedriver),
# installed when missing and this user may (root, apt-get). Elsewhere that test skips, saying so
# (CI sets EXPKIT_REQUIRE_BROWSER=1: there it fails instead).
set -uo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/setup_browser.sh: Chromium is not installed; the browser test skips (sudo apt-get install chromium chromium-driver)" >&2
    exit 0
fi
echo "scripts/setup_browser.sh: installing Debian's chromium and chromium-driver (for the browser test)"
if ! { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }; then
    echo "scripts/setup_browser.sh: apt-get install chromium chromium-driver failed" >&2
fi
exit 0
