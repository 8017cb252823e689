//! Values as Python writes them, for transformers' chat templates: `str` ([`python_str`]) and
//! JSON as Python's `json.dumps` writes it: what transformers' chat templates get from their
//! `tojson` filter (`json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`, each settable from the template). minijinja's own `tojson` differs in
//! every way that changes a rendered prompt: no spaces after `,` and `:`, sorted keys, and
//! `<`, `>`, `&` and `'` escaped for HTML. Tool calls and tool schemas reach the prompt
//! through it (Qwen2.5's and Qwen3's templates, Llama 3.1's), so their tokens are trained on.

use minijinja::{Error, ErrorKind, Value, value::{Kwargs, ValueKind}};

/// How `json.dumps` was asked to write.
struct Style {
    ensure_ascii: bool,
    /// `None`: one line.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// The longest indent `tojson` writes (templates use 2 or 4): one read from a template is
/// repeated on every line at every level, and a huge one would take the host's memory.
const LONGEST_INDENT: usize = 64;

/// The `tojson` filter of transformers' chat templates.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(indent) if indent.is_none() => None,
        Some(indent) => Some(match indent.as_str() {
            Some(text) if text.chars().count() <= LONGEST_INDENT => text.to_string(),
            Some(text) => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: an indent of {} characters is past the {LONGEST_INDENT} this renderer writes", text.chars().count()))),
            None => {
                let spaces = indent.as_i64().ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "tojson: indent must be a number or a string"))?;
                if spaces > LONGEST_INDENT as i64 {
                    return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: indent={spaces} is past the {LONGEST_INDENT} spaces this renderer writes")));
                }
                " ".repeat(spaces.max(0) as usize)
            }
        }),
    };
    // Python's defaults: ", " and ": " on one line, "," before a line break.
    let (mut item_separator, mut key_separator) = (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string());
    if let Some(separators) = kwargs.get::<Option<Value>>("separators")?.filter(|s| !s.is_none()) {
        let pair: Vec<Value> = separators.try_iter()?.collect();
        match pair.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                (item_separator, key_separator) = (item.as_str().unwrap().to_string(), key.as_str().unwrap().to_string());
            }
            _ => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be two strings, (item, key)")),
        }
    }
    let style = Style {
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        item_separator,
        key_separator,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&value, &style, 0, &mut out)?;
    Ok(out)
}

fn write_value(value: &Value, style: &Style, level: usize, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&python_float(f64::try_from(value.clone())?)),
        ValueKind::String => write_string(value.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, style, level, ('[', ']'), &items, |item, out| write_value(item, style, level + 1, out))?;
        }
        ValueKind::Map => {
            let mut pairs: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                pairs.push((map_key(&key)?, item));
            }
            if style.sort_keys {
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, style, level, ('{', '}'), &pairs, |(key, item), out| {
                write_string(key, style.ensure_ascii, out);
                out.push_str(&style.key_separator);
                write_value(item, style, level + 1, out)
            })?;
        }
        kind => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: a value of kind {kind} is not JSON serializable"))),
    }
    Ok(())
}

/// `[`items`]` or `{`items`}`, one line or one item a line.
fn write_container<T>(out: &mut String, style: &Style, level: usize, (open, close): (char, char), items: &[T], mut write: impl FnMut(&T, &mut String) -> Result<(), Error>) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let line = |level: usize| style.indent.as_ref().map(|indent| format!("\n{}", indent.repeat(level)));
    if let Some(line) = line(level + 1) {
        out.push_str(&line);
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&style.item_separator);
            if let Some(line) = line(level + 1) {
                out.push_str(&line);
            }
        }
        write(item, out)?;
    }
    if let Some(line) = line(level) {
        out.push_str(&line);
    }
    out.push(close);
    Ok(())
}

/// A map's key as `json.dumps` writes it: strings as they are, numbers, booleans and None
/// spelt as JSON.
fn map_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
            let mut out = String::new();
            write_value(key, &Style { ensure_ascii: false, indent: None, item_separator: String::new(), key_separator: String::new(), sort_keys: false }, 0, &mut out)?;
            Ok(out)
        }
        kind => Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: keys must be strings, numbers, booleans or None, not {kind}"))),
    }
}

/// A string in JSON's quotes, escaped as Python's encoder escapes it.
fn write_string(text: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            // Python's ASCII mode escapes all but ' '..='~' (DEL too).
            c if (c as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&c)) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A value as Python's `str` writes it: what transformers' templates print for `{{ value }}`
/// and `value | string` (a dict as `{'city': 'Paris'}`, `1e-05`, `True`, `None`), where
/// minijinja prints a map as JSON and `1e-05` as `0.00001`. A string is itself; what it holds,
/// `repr`: tool-call arguments that are no string reach the prompt so (Qwen's coder templates).
pub fn python_str(value: &Value) -> Result<String, Error> {
    match value.kind() {
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_string()),
        ValueKind::Undefined => Ok(String::new()),
        _ => {
            let mut out = String::new();
            write_repr(value, &mut out)?;
            Ok(out)
        }
    }
}

/// Python's `repr` of a value.
fn write_repr(value: &Value, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let x = f64::try_from(value.clone())?;
            out.push_str(&match x {
                x if x.is_nan() => "nan".to_string(),
                x if x.is_infinite() => if x > 0.0 { "inf" } else { "-inf" }.to_string(),
                x => python_float(x),
            });
        }
        ValueKind::String => write_python_string(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                out.push_str(if i > 0 { ", " } else { "" });
                write_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                out.push_str(if i > 0 { ", " } else { "" });
                write_repr(&key, out)?;
                out.push_str(": ");
                write_repr(&value.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

/// The assigned characters Python's `str.isprintable` refuses, which `repr` escapes: controls
/// (Cc), formats (Cf: a soft hyphen, zero widths, bidi marks, the BOM), separators other than
/// the space (Zs, Zl, Zp: a no-break space, U+3000, U+2028) and private use (Co), as Python 3.11
/// (Unicode 14) has them. Unassigned code points (Cn), which Python escapes too, are left as
/// they are: no tokenizer's text holds them.
const NOT_PRINTABLE: [(u32, u32); 28] = [
    (0x0, 0x1F), (0x7F, 0xA0), (0xAD, 0xAD), (0x600, 0x605), (0x61C, 0x61C), (0x6DD, 0x6DD), (0x70F, 0x70F),
    (0x890, 0x891), (0x8E2, 0x8E2), (0x1680, 0x1680), (0x180E, 0x180E), (0x2000, 0x200F), (0x2028, 0x202F),
    (0x205F, 0x2064), (0x2066, 0x206F), (0x3000, 0x3000), (0xE000, 0xF8FF), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001), (0xE0020, 0xE007F), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD),
];

/// A string in Python's `repr` quotes: single, or double where it holds a single quote and no
/// double one; backslashes, line ends and tabs escaped, and other characters Python does not
/// print as `\xNN`, `\uNNNN` or `\UNNNNNNNN` ([`NOT_PRINTABLE`]).
fn write_python_string(text: &str, out: &mut String) {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if NOT_PRINTABLE.iter().any(|&(first, last)| (first..=last).contains(&(c as u32))) => {
                let code = c as u32;
                out.push_str(&match code {
                    ..=0xff => format!("\\x{code:02x}"),
                    ..=0xffff => format!("\\u{code:04x}"),
                    _ => format!("\\U{code:08x}"),
                })
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A float as Python's `repr` writes it: the shortest digits that read back the same, fixed
/// between 1e-4 and 1e16 (`0.0001`, `1.0`), else in exponent form (`1e-05`, `1e+16`);
/// `NaN` and `Infinity` as `json.dumps` allows them.
fn python_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `1.2345e-7`, `-5e0`.
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').expect("{:e} writes an exponent");
    let exponent: i32 = exponent.parse().expect("an integer exponent");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if !(-4..16).contains(&exponent) {
        let mantissa = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{exponent_sign}{:02}", exponent.abs());
    }
    let point = exponent + 1;
    let fixed = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
    };
    format!("{sign}{fixed}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against CPython 3's `str` (`print(str({...}))`): a dict of a string, floats, a boolean,
    /// None and a list of strings that need each kind of quote and escape.
    #[test]
    fn values_are_printed_as_python_prints_them() {
        let value = Value::from_serialize(serde_json::json!({
            "city": "Paris", "n": 1e-05, "ok": true, "none": null,
            "l": [1, 2.5, "it's", "a\"b", "x\ny\\z"], "f": 1e16, "big": 123.0
        }));
        let python = r#"{'city': 'Paris', 'n': 1e-05, 'ok': True, 'none': None, 'l': [1, 2.5, "it's", 'a"b', 'x\ny\\z'], 'f': 1e+16, 'big': 123.0}"#;
        assert_eq!(python_str(&value).unwrap(), python);
        // What Python does not print, escaped as it escapes it; accents, CJK and emoji as they are.
        let spaces = Value::from_serialize(serde_json::json!({"a": "x\u{a0}y\u{3000}z\u{200b}\u{2028}\u{85}\u{7f}\u{f0001} é ü 中 😀"}));
        assert_eq!(python_str(&spaces).unwrap(), r"{'a': 'x\xa0y\u3000z\u200b\u2028\x85\x7f\U000f0001 é ü 中 😀'}");
        for (value, python) in [(Value::from(1e-05), "1e-05"), (Value::from(0.1 + 0.2), "0.30000000000000004"), (Value::from(f64::NAN), "nan"), (Value::from(true), "True"), (Value::from(()), "None"), (Value::from("it's"), "it's")] {
            assert_eq!(python_str(&value).unwrap(), python);
        }
    }

    /// Each against `repr(float(x))` in CPython 3.
    #[test]
    fn floats_are_written_as_python_writes_them() {
        for (x, python) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.5, "0.5"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123.456, "123.456"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345678901234568e17, "1.2345678901234568e+17"),
            (-2.5e-300, "-2.5e-300"),
            (0.1 + 0.2, "0.30000000000000004"),
            (f64::INFINITY, "Infinity"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(python_float(x), python, "{x:e}");
        }
    }

    /// An indent from a template is repeated on every line: one past 64 is refused by name (a
    /// template's `tojson(indent=10**12)` took the host's memory); 4 writes Python's layout.
    #[test]
    fn an_indent_past_64_is_refused() {
        let env = {
            let mut env = minijinja::Environment::new();
            env.add_filter("tojson", tojson);
            env
        };
        let render = |template: &str| env.render_str(template, minijinja::context! { x => serde_json::json!({"a": [1]}) }).map_err(|e| e.to_string());
        assert_eq!(render("{{ x | tojson(indent=4) }}").unwrap(), "{\n    \"a\": [\n        1\n    ]\n}");
        for template in ["{{ x | tojson(indent=65) }}", &format!("{{{{ x | tojson(indent='{}') }}}}", " ".repeat(65)), "{{ x | tojson(indent=1000000000000) }}"] {
            let error = render(template).expect_err(template);
            assert!(error.contains("is past the 64"), "{template}: {error}");
        }
    }
}
