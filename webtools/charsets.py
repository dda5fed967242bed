"""Charset labels → text, as a browser decodes them (WHATWG Encoding Standard).

The one table of which charset labels mean what. A label is looked up in the
Encoding Standard's label table (ASCII whitespace stripped, ASCII lower-cased);
a label that is not in it — `undefined`, `punycode`, `idna`, `base64`,
`utf-7`, or any other Python codec that is not a web text encoding — is not
an encoding, and the bytes decode as UTF-8 with replacement, as browsers do.
Every codec used here decodes in linear time (punycode, for one, does not).

`decode` is for any text body (a byte order mark wins, then the label, then
UTF-8); `decode_html` adds HTML's steps (a BOM wins over the header charset,
then the header's charset, then the document's own `<meta charset>` in its
first 4 KiB, then UTF-8). Undecodable bytes become U+FFFD; nothing here raises.
"""

from __future__ import annotations

import codecs
import re

__all__ = ["LABELS", "lookup", "decode", "decode_html"]

# Encoding Standard name -> its labels. Python's codec for each is in _CODECS.
_ENCODINGS: dict[str, tuple[str, ...]] = {
    "UTF-8": ("unicode-1-1-utf-8", "unicode11utf8", "unicode20utf8", "utf-8", "utf8", "x-unicode20utf8"),
    "IBM866": ("866", "cp866", "csibm866", "ibm866"),
    "ISO-8859-2": ("csisolatin2", "iso-8859-2", "iso-ir-101", "iso8859-2", "iso88592", "iso_8859-2",
                   "iso_8859-2:1987", "l2", "latin2"),
    "ISO-8859-3": ("csisolatin3", "iso-8859-3", "iso-ir-109", "iso8859-3", "iso88593", "iso_8859-3",
                   "iso_8859-3:1988", "l3", "latin3"),
    "ISO-8859-4": ("csisolatin4", "iso-8859-4", "iso-ir-110", "iso8859-4", "iso88594", "iso_8859-4",
                   "iso_8859-4:1988", "l4", "latin4"),
    "ISO-8859-5": ("csisolatincyrillic", "cyrillic", "iso-8859-5", "iso-ir-144", "iso8859-5", "iso88595",
                   "iso_8859-5", "iso_8859-5:1988"),
    "ISO-8859-6": ("arabic", "asmo-708", "csiso88596e", "csiso88596i", "csisolatinarabic", "ecma-114",
                   "iso-8859-6", "iso-8859-6-e", "iso-8859-6-i", "iso-ir-127", "iso8859-6", "iso88596",
                   "iso_8859-6", "iso_8859-6:1987"),
    "ISO-8859-7": ("csisolatingreek", "ecma-118", "elot_928", "greek", "greek8", "iso-8859-7", "iso-ir-126",
                   "iso8859-7", "iso88597", "iso_8859-7", "iso_8859-7:1987", "sun_eu_greek"),
    "ISO-8859-8": ("csiso88598e", "csisolatinhebrew", "hebrew", "iso-8859-8", "iso-8859-8-e", "iso-ir-138",
                   "iso8859-8", "iso88598", "iso_8859-8", "iso_8859-8:1988", "visual"),
    "ISO-8859-8-I": ("csiso88598i", "iso-8859-8-i", "logical"),
    "ISO-8859-10": ("csisolatin6", "iso-8859-10", "iso-ir-157", "iso8859-10", "iso885910", "l6", "latin6"),
    "ISO-8859-13": ("iso-8859-13", "iso8859-13", "iso885913"),
    "ISO-8859-14": ("iso-8859-14", "iso8859-14", "iso885914"),
    "ISO-8859-15": ("csisolatin9", "iso-8859-15", "iso8859-15", "iso885915", "iso_8859-15", "l9"),
    "ISO-8859-16": ("iso-8859-16",),
    "KOI8-R": ("cskoi8r", "koi", "koi8", "koi8-r", "koi8_r"),
    "KOI8-U": ("koi8-ru", "koi8-u"),
    "macintosh": ("csmacintosh", "mac", "macintosh", "x-mac-roman"),
    "windows-874": ("dos-874", "iso-8859-11", "iso8859-11", "iso885911", "tis-620", "windows-874"),
    "windows-1250": ("cp1250", "windows-1250", "x-cp1250"),
    "windows-1251": ("cp1251", "windows-1251", "x-cp1251"),
    "windows-1252": ("ansi_x3.4-1968", "ascii", "cp1252", "cp819", "csisolatin1", "ibm819", "iso-8859-1",
                     "iso-ir-100", "iso8859-1", "iso88591", "iso_8859-1", "iso_8859-1:1987", "l1", "latin1",
                     "us-ascii", "windows-1252", "x-cp1252"),
    "windows-1253": ("cp1253", "windows-1253", "x-cp1253"),
    "windows-1254": ("cp1254", "csisolatin5", "iso-8859-9", "iso-ir-148", "iso8859-9", "iso88599", "iso_8859-9",
                     "iso_8859-9:1989", "l5", "latin5", "windows-1254", "x-cp1254"),
    "windows-1255": ("cp1255", "windows-1255", "x-cp1255"),
    "windows-1256": ("cp1256", "windows-1256", "x-cp1256"),
    "windows-1257": ("cp1257", "windows-1257", "x-cp1257"),
    "windows-1258": ("cp1258", "windows-1258", "x-cp1258"),
    "x-mac-cyrillic": ("x-mac-cyrillic", "x-mac-ukrainian"),
    "GBK": ("chinese", "csgb2312", "csiso58gb231280", "gb2312", "gb_2312", "gb_2312-80", "gbk", "iso-ir-58",
            "x-gbk"),
    "gb18030": ("gb18030",),
    "Big5": ("big5", "big5-hkscs", "cn-big5", "csbig5", "x-x-big5"),
    "EUC-JP": ("cseucpkdfmtjapanese", "euc-jp", "x-euc-jp"),
    "ISO-2022-JP": ("csiso2022jp", "iso-2022-jp"),
    "Shift_JIS": ("csshiftjis", "ms932", "ms_kanji", "shift-jis", "shift_jis", "sjis", "windows-31j", "x-sjis"),
    "EUC-KR": ("cseuckr", "csksc56011987", "euc-kr", "iso-ir-149", "korean", "ks_c_5601-1987", "ks_c_5601-1989",
               "ksc5601", "ksc_5601", "windows-949"),
    "replacement": ("csiso2022kr", "hz-gb-2312", "iso-2022-cn", "iso-2022-cn-ext", "iso-2022-kr", "replacement"),
    "UTF-16BE": ("unicodefffe", "utf-16be"),
    "UTF-16LE": ("csunicode", "iso-10646-ucs-2", "ucs-2", "unicode", "unicodefeff", "utf-16", "utf-16le"),
    "x-user-defined": ("x-user-defined",),
}

# The Python codec that decodes each encoding as the standard does (the
# nearest superset where Python's namesake is narrower: the standard's GBK is
# gb18030, Big5 is Big5-HKSCS, Shift_JIS is Windows-31J, EUC-KR is Windows-949).
# "replacement" and "x-user-defined" are decoded here, not by a codec.
_CODECS: dict[str, str] = {
    "UTF-8": "utf-8", "IBM866": "cp866", "ISO-8859-2": "iso8859-2", "ISO-8859-3": "iso8859-3",
    "ISO-8859-4": "iso8859-4", "ISO-8859-5": "iso8859-5", "ISO-8859-6": "iso8859-6", "ISO-8859-7": "iso8859-7",
    "ISO-8859-8": "iso8859-8", "ISO-8859-8-I": "iso8859-8", "ISO-8859-10": "iso8859-10",
    "ISO-8859-13": "iso8859-13", "ISO-8859-14": "iso8859-14", "ISO-8859-15": "iso8859-15",
    "ISO-8859-16": "iso8859-16", "KOI8-R": "koi8-r", "KOI8-U": "koi8-u", "macintosh": "mac-roman",
    "windows-874": "cp874", "windows-1250": "cp1250", "windows-1251": "cp1251", "windows-1252": "cp1252",
    "windows-1253": "cp1253", "windows-1254": "cp1254", "windows-1255": "cp1255", "windows-1256": "cp1256",
    "windows-1257": "cp1257", "windows-1258": "cp1258", "x-mac-cyrillic": "mac-cyrillic", "GBK": "gb18030",
    "gb18030": "gb18030", "Big5": "big5hkscs", "EUC-JP": "euc-jp", "ISO-2022-JP": "iso2022-jp",
    "Shift_JIS": "cp932", "EUC-KR": "cp949", "UTF-16BE": "utf-16-be", "UTF-16LE": "utf-16-le",
}

# label -> Encoding Standard name
LABELS: dict[str, str] = {label: name for name, labels in _ENCODINGS.items() for label in labels}

_ASCII_WS = " \t\n\f\r"
_BOMS = ((codecs.BOM_UTF8, "UTF-8"), (codecs.BOM_UTF16_BE, "UTF-16BE"), (codecs.BOM_UTF16_LE, "UTF-16LE"))
# x-user-defined: bytes 0x80-0xFF are U+F780-U+F7FF (after a latin-1 decode).
_USER_DEFINED = {0x80 + i: 0xF780 + i for i in range(128)}
_META_CHARSET = re.compile(
    rb"""<meta[^>]{0,512}?charset\s*=\s*["']?\s*([A-Za-z0-9_.:\-]{1,40})""", re.IGNORECASE)


def lookup(label: str | bytes | None) -> str | None:
    """The Encoding Standard's name for `label` ("latin1" -> "windows-1252"), or None when it is not a label."""
    if not label:
        return None
    if isinstance(label, bytes):
        label = label.decode("ascii", "replace")
    if len(label) > 64:
        return None
    return LABELS.get(label.strip(_ASCII_WS).strip("\"'").lower())


def _bom(data: bytes) -> tuple[str | None, int]:
    for bom, name in _BOMS:
        if data.startswith(bom):
            return name, len(bom)
    return None, 0


def _decode_as(data: bytes, encoding: str | None) -> str:
    if encoding == "replacement":  # an encoding that must never be decoded: one U+FFFD, as the standard says
        return "\ufffd" if data else ""
    if encoding == "x-user-defined":
        return data.decode("latin-1").translate(_USER_DEFINED)
    return data.decode(_CODECS.get(encoding or "UTF-8", "utf-8"), "replace")


def decode(data: bytes, label: str | None) -> str:
    """A text body as a browser decodes it: BOM, else `label` (a WHATWG label), else UTF-8."""
    data = bytes(data)
    bom, skip = _bom(data)
    if bom:
        return _decode_as(data[skip:], bom)
    return _decode_as(data, lookup(label))


def decode_html(data: bytes, label: str | None) -> str:
    """An HTML document as a browser decodes it: BOM, else the header's `label`,
    else `<meta charset>` in the first 4 KiB, else UTF-8."""
    data = bytes(data)
    bom, skip = _bom(data)
    if bom:
        return _decode_as(data[skip:], bom)
    encoding = lookup(label)
    if encoding is None:
        m = _META_CHARSET.search(data, 0, 4096)
        encoding = lookup(m.group(1)) if m else None
        # HTML's prescan: a meta tag we could read as ASCII is not UTF-16, and
        # x-user-defined there means windows-1252.
        if encoding in {"UTF-16LE", "UTF-16BE"}:
            encoding = "UTF-8"
        elif encoding == "x-user-defined":
            encoding = "windows-1252"
    return _decode_as(data, encoding)
