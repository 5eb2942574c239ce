import numpy as np
import pytest

from tritonguard.core.config import from_params
from tritonguard.core.errors import ConfigError
from tritonguard.privacy.redaction import RedactionConfig, Redactor, iban_ok, luhn_ok


def redactor(**params):
    return Redactor(from_params(RedactionConfig, {k: str(v) for k, v in params.items()}, section="redaction"))


R = redactor()


def red(text):
    out, counts = R.redact_batch([text])
    return out[0], counts


@pytest.mark.parametrize("text,expected,kind", [
    ("mail John.Doe+tag@Example.COM now", "mail [EMAIL] now", "EMAIL"),
    ("MAIL JOHN@EXAMPLE.CO.UK.", "MAIL [EMAIL].", "EMAIL"),
    ("card 4111 1111 1111 1111 ok", "card [CREDIT_CARD] ok", "CREDIT_CARD"),
    ("card 4111-1111-1111-1111", "card [CREDIT_CARD]", "CREDIT_CARD"),
    ("card 4111111111111111.", "card [CREDIT_CARD].", "CREDIT_CARD"),
    ("amex 3782 822463 10005", "amex [CREDIT_CARD]", "CREDIT_CARD"),
    ("ssn 123-45-6789", "ssn [SSN]", "SSN"),
    ("from 192.168.1.20:8080", "from [IPV4]:8080", "IPV4"),
    ("loopback ::1 here", "loopback [IPV6] here", "IPV6"),
    ("v6 2001:db8::8a2e:370:7334.", "v6 [IPV6].", "IPV6"),
    ("v6 2001:0DB8:0000:0000:0000:FF00:0042:8329", "v6 [IPV6]", "IPV6"),
    ("mapped ::ffff:10.0.0.1 x", "mapped [IPV6] x", "IPV6"),
    ("iban GB82 WEST 1234 5698 7654 32 thanks", "iban [IBAN] thanks", "IBAN"),
    ("iban gb82west12345698765432", "iban [IBAN]", "IBAN"),
    ("iban BE68 5390 0754 7034 from me", "iban [IBAN] from me", "IBAN"),
    ("call (415) 555-2671 today", "call [PHONE] today", "PHONE"),
    ("call 415-555-2671", "call [PHONE]", "PHONE"),
    ("call +1 415 555 2671", "call [PHONE]", "PHONE"),
    ("call +44 20 7946 0958", "call [PHONE]", "PHONE"),
    ("call +4915112345678", "call [PHONE]", "PHONE"),
])
def test_true_positives(text, expected, kind):
    out, counts = red(text)
    assert out == expected
    assert counts == {kind: 1}


@pytest.mark.parametrize("text", [
    "2024-01-15 10:23:45.123 INFO worker-3 request 8842 done in 12.5ms",
    "2024-01-15T10:23:45Z took 1500 ms",
    "release 1.2.3.4000 and 10.20.30 and 1.2.3.4.5",
    "bad octets 999.10.10.10",
    "order 1234567890 and ORD-20240115-0042 and #12345678",
    "tracking 1234 5678 9012 3456",  # 16 digits, Luhn fails
    "id 1234567812345678",
    "placeholder 0000 0000 0000 0000",
    "ssn-like but invalid 000-12-3456 666-12-3456 912-34-5678",
    "year 2024, count 415 555, total 100-200-3000",
    "std::vector<int> and Foo::Bar and a :: b and 12:30:45",
    "mac 00:1a:2b:3c:4d:5e",
    "not an iban GB00 WEST 1234 5698 7654 32",
    "user@localhost and @handle and a@b",
    "expr x+1 = 2",
])
def test_false_positives(text):
    out, counts = red(text)
    assert out == text, out
    assert counts == {}


def test_batch_counts_and_order():
    texts = ["a@b.io and c@d.io", "nothing", "4111111111111111 / ::1"]
    out, counts = R.redact_batch(texts)
    assert out == ["[EMAIL] and [EMAIL]", "nothing", "[CREDIT_CARD] / [IPV6]"]
    assert counts == {"EMAIL": 2, "CREDIT_CARD": 1, "IPV6": 1}


def test_custom_pattern_replacement_and_subset():
    r = redactor(**{"pattern.employee_id": r"EMP-\d{6}", "replacement": "<{type}>", "recognizers": "EMAIL"})
    out, counts = r.redact_batch(["emp-123456 mailed a@b.io from 10.0.0.1"])
    assert out == ["<EMPLOYEE_ID> mailed <EMAIL> from 10.0.0.1"]
    assert counts == {"EMPLOYEE_ID": 1, "EMAIL": 1}


@pytest.mark.parametrize("params,word", [
    ({"recognizers": "EMAIL,PASSPORT"}, "PASSPORT"),
    ({"pattern.x": "(a)"}, "non-capturing"),
    ({"pattern.x": "a*"}, "empty"),
    ({"pattern.x": "("}, "invalid regex"),
    ({"pattern.EMAIL": "x"}, "built-in"),
    ({"replacement": "[{kind}]"}, "replacement"),
])
def test_config_errors(params, word):
    with pytest.raises(ConfigError, match=word):
        redactor(**params)


def test_disabled_is_identity():
    r = redactor(enabled="false")
    texts = ["a@b.io"]
    assert r.redact_batch(texts) == (texts, {})
    assert not r.active


def test_bytes_array_keeps_shape_and_untouched_objects():
    clean = b"no pii here"
    arr = np.array([[clean], ["caf\u00e9 a@b.io".encode()], [b"\xff raw ::1"]], dtype=object)
    out, counts = R.redact_bytes_array(arr)
    assert out.shape == arr.shape and out.dtype == object
    assert out[0, 0] is clean
    assert out[1, 0] == "caf\u00e9 [EMAIL]".encode()
    assert out[2, 0] == b"\xff raw [IPV6]"  # invalid UTF-8 survives untouched
    assert counts == {"EMAIL": 1, "IPV6": 1}


def test_checksums():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert iban_ok("GB82WEST12345698765432") and not iban_ok("GB82WEST12345698765433")


def test_checksums_agree_with_stdnum():
    """The hand-written checks (kept for speed, see redaction.py) against python-stdnum."""
    from stdnum import iban, luhn

    rng = np.random.default_rng(16)
    for _ in range(2000):
        digits = "".join(map(str, rng.integers(0, 10, rng.integers(13, 20))))
        assert luhn_ok(digits) == luhn.is_valid(digits), digits
        valid = digits[:-1] + luhn.calc_check_digit(digits[:-1])
        assert luhn_ok(valid) and luhn.is_valid(valid)
    for example in ("GB82WEST12345698765432", "BE68539007547034", "DE89370400440532013000", "FR1420041010050500013M02606"):
        for _ in range(200):
            bban = "".join(c if not c.isdigit() else str(rng.integers(0, 10)) for c in example[4:])
            good = example[:2] + iban.calc_check_digits(example[:2] + "00" + bban) + bban
            assert iban_ok(good) and iban.is_valid(good, check_country=False), good
            k = int(rng.integers(4, len(good)))
            if good[k].isdigit():  # mod 97 catches every single-character error
                bad = good[:k] + str((int(good[k]) + 1) % 10) + good[k + 1:]
                assert not iban_ok(bad) and not iban.is_valid(bad, check_country=False), bad


def test_phonenumbers_examples_are_redacted():
    """Every region's example mobile and fixed-line number of 8+ digits, as phonenumbers writes it
    internationally, is redacted (the hand-written check is looser than is_valid_number, not stricter)."""
    import phonenumbers as pn

    seen = 0
    for region in sorted(pn.SUPPORTED_REGIONS):
        for kind in (pn.PhoneNumberType.MOBILE, pn.PhoneNumberType.FIXED_LINE):
            number = pn.example_number_for_type(region, kind)
            if number is None:
                continue
            text = pn.format_number(number, pn.PhoneNumberFormat.INTERNATIONAL)
            if sum(c.isdigit() for c in text) < 8:  # a few territories' 7-digit numbers: not covered
                continue
            seen += 1
            assert red(f"call {text} now") == ("call [PHONE] now", {"PHONE": 1}), (region, text)
    assert seen > 400
