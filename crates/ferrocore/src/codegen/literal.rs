//! The literal writers: the one way a string or number becomes text of a generated language.
//! Python (the wrapper module and Triton kernels, which are Python source) and C++. Whatever
//! the graph says, the text they write parses back to exactly that value and cannot end the
//! literal or comment early. Names are not written here: buffer and kernel names are made
//! identifiers where they are created (`loop_ir::input_buffer_name` and `wrapper::names`, the scheduler's
//! `kernel_name`).

use std::fmt::Write;

/// A Python string literal for any text: printable ASCII as is, everything else escaped.
pub fn py_str(s: &str) -> String {
    let mut out = String::from("'");
    push_py_escaped(&mut out, s, true);
    out.push('\'');
    out
}

/// Printable ASCII as is (backslash doubled, and the quote with `quote`), any other char as a
/// `\uXXXX` / `\UXXXXXXXX` escape: no newline, NUL, bidi control or line separator survives.
fn push_py_escaped(out: &mut String, s: &str, quote: bool) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' if quote => out.push_str("\\'"),
            ' '..='~' => out.push(c),
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
}

/// A Python string literal for a long source text (C++ kernels): a readable raw triple-quoted
/// block where the text can be one byte for byte, else `py_str`.
pub fn py_source_str(s: &str) -> String {
    // a raw string keeps `\'` (no end) and cannot end in `\` or `'`; Python reads a `\r` as `\n`
    let raw_ok = s.chars().all(|c| c == '\n' || (' '..='~').contains(&c))
        && !s.contains("'''")
        && !s.contains("\\'")
        && !s.ends_with('\\')
        && !s.ends_with('\'');
    if raw_ok {
        format!("r'''{s}'''")
    } else {
        py_str(s)
    }
}

/// A Python float literal (an expression for the non-finite values).
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        "float('nan')".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "float('inf')".into()
        } else {
            "float('-inf')".into()
        }
    } else {
        // Rust's shortest round-trip form (`0.1`, `-0.0`, `5e-324`, `1e300`) is valid Python
        format!("{f:?}")
    }
}

pub fn py_int(i: i64) -> String {
    i.to_string()
}

pub fn py_bool(b: bool) -> String {
    if b {
        "True".into()
    } else {
        "False".into()
    }
}

/// Text for a Python comment (after `# `): one line, escaped like a string's content.
pub fn py_comment(s: &str) -> String {
    let mut out = String::new();
    push_py_escaped(&mut out, s, false);
    out
}

/// A C++ constant of floating type `ty` (`float` or `double`) equal to `f` rounded to `ty`.
pub fn cpp_float(f: f64, ty: &str) -> String {
    if f.is_nan() {
        return format!("std::numeric_limits<{ty}>::quiet_NaN()");
    }
    if f.is_infinite() {
        let s = if f > 0.0 { "" } else { "-" };
        return format!("{s}std::numeric_limits<{ty}>::infinity()");
    }
    // the shortest form that reads back as `f` (`1e-1`, `-0e0`, `5e-324`): a double literal
    let s = format!("{f:e}");
    if ty == "float" {
        format!("static_cast<float>({s})")
    } else {
        s
    }
}

/// A C++ constant of integer type `ty` equal to `i`. `-9223372036854775808LL` is the negation
/// of a literal too large for `long long`, so the minimum is written as a difference.
pub fn cpp_int(i: i64, ty: &str) -> String {
    if i == i64::MIN {
        format!("static_cast<{ty}>(-9223372036854775807LL - 1)")
    } else {
        format!("static_cast<{ty}>({i}LL)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// Text no literal writer may let through unescaped.
    fn awkward_strings() -> Vec<String> {
        let mut v: Vec<String> = [
            "",
            "plain",
            "'",
            "\"",
            "'''",
            "\"\"\"",
            "\\",
            "ends in a backslash\\",
            "\\'",
            "a\nb",
            "a\rb",
            "a\r\nb",
            "\t",
            "\0",
            "nul\0inside",
            "ctrl\x01\x1b\x7f",
            "\u{2028}\u{2029}",
            "\u{202e}evil\u{202c}",
            "\u{feff}bom",
            "\u{85}next line",
            "\u{1f600} astral \u{10ffff}",
            "é ü 中文",
            "*/ // # /*",
            "__import__('os').system('true')",
            "{}{{}}%s%d",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.push((0u32..0x80).filter_map(char::from_u32).collect());
        v
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn run(cmd: &mut Command) -> String {
        let out = cmd.output().expect("the test needs python3 and g++ on PATH");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn python_string_literals_read_back_exactly() {
        let strings = awkward_strings();
        // each literal on a line of its own, read by Python's parser (not exec)
        let mut program = String::from("lits = [\n");
        for s in &strings {
            let _ = writeln!(program, "    {},", py_str(s));
            let _ = writeln!(program, "    {},", py_source_str(s));
        }
        program.push_str("]\nfor l in lits:\n    print(l.encode('utf-8', 'surrogatepass').hex())\n");
        let got = run(Command::new("python3").arg("-c").arg(&program));
        let want: String = strings.iter().flat_map(|s| [hex(s.as_bytes()), hex(s.as_bytes())]).map(|h| h + "\n").collect();
        assert_eq!(got, want);
        for s in &strings {
            let lit = py_str(s);
            assert!(lit.chars().all(|c| (' '..='~').contains(&c)), "{lit}");
            let out = run(Command::new("python3")
                .arg("-c")
                .arg("import ast, sys; print(ast.literal_eval(sys.argv[1]).encode().hex())")
                .arg(&lit));
            assert_eq!(out.trim(), hex(s.as_bytes()), "{lit}");
        }
    }

    #[test]
    fn python_comments_stay_on_their_line() {
        let mut program = String::new();
        for s in awkward_strings() {
            let _ = writeln!(program, "x = 1  # {}", py_comment(&s));
        }
        program.push_str("print(x)\n");
        let tree =
            run(Command::new("python3").arg("-c").arg("import ast, sys; t = ast.parse(sys.argv[1]); print(len(t.body))").arg(&program));
        assert_eq!(tree.trim(), (awkward_strings().len() + 1).to_string());
    }

    fn awkward_floats() -> Vec<f64> {
        vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            0.1,
            1.0 / 3.0,
            1e16,
            1e-7,
            123456789.0,
            f64::MAX,
            f64::MIN,
            f64::MIN_POSITIVE,
            5e-324,
            -5e-324,
            2.225_073_858_507_201e-308,
            f32::MAX as f64,
            f32::MIN_POSITIVE as f64,
            1e-45,
            f64::EPSILON,
            9007199254740993.0,
        ]
    }

    #[test]
    fn python_numbers_read_back_exactly() {
        let mut floats: Vec<f64> = awkward_floats();
        floats.extend([f64::INFINITY, f64::NEG_INFINITY]);
        let lits: Vec<String> = floats.iter().map(|f| py_float(*f)).collect();
        let ints = [0, 1, -1, i64::MAX, i64::MIN, i32::MIN as i64];
        let program = format!(
            "import struct\nfor v in [{}]:\n    print(struct.pack('<d', v).hex())\nprint([{}])\nprint({}, {})\nprint({} != {})",
            lits.join(", "),
            ints.iter().map(|i| py_int(*i)).collect::<Vec<_>>().join(", "),
            py_bool(true),
            py_bool(false),
            py_float(f64::NAN),
            py_float(f64::NAN)
        );
        let got = run(Command::new("python3").arg("-c").arg(&program));
        let mut want: String = floats.iter().map(|f| hex(&f.to_le_bytes()) + "\n").collect();
        want += &format!("{ints:?}\nTrue False\nTrue\n");
        assert_eq!(got, want);
    }

    #[test]
    fn cpp_numbers_compile_to_the_same_bits() {
        let dir = std::env::temp_dir().join(format!("ferrocore_literal_test_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut floats = awkward_floats();
        floats.extend([f64::INFINITY, f64::NEG_INFINITY]);
        let ints = [0, 1, -1, i64::MAX, i64::MIN, i32::MIN as i64];
        let mut src = String::from("#include <cstdio>\n#include <cstdint>\n#include <cstring>\n#include <limits>\nint main() {\n");
        for (ty, bits) in [("double", "uint64_t"), ("float", "uint32_t")] {
            for f in &floats {
                let _ = writeln!(
                    src,
                    "  {{ {ty} v = {}; {bits} b; std::memcpy(&b, &v, sizeof b); std::printf(\"%llx\\n\", (unsigned long long)b); }}",
                    cpp_float(*f, ty)
                );
            }
        }
        for i in ints {
            let _ = writeln!(src, "  std::printf(\"%lld\\n\", (long long){});", cpp_int(i, "int64_t"));
        }
        let _ = writeln!(src, "  {{ double n = {}; std::printf(\"%d\\n\", n != n); }}\n  return 0;\n}}", cpp_float(f64::NAN, "double"));
        std::fs::write(dir.join("t.cpp"), &src).unwrap();
        run(Command::new("g++").args(["-std=c++17", "-Werror", "-o"]).arg(dir.join("t")).arg(dir.join("t.cpp")));
        let got = run(&mut Command::new(dir.join("t")));
        let _ = std::fs::remove_dir_all(&dir);
        let mut want = String::new();
        for f in &floats {
            want += &format!("{:x}\n", f.to_bits());
        }
        for f in &floats {
            // what a C++ cast of the double to float gives: round to nearest, overflow to inf
            want += &format!("{:x}\n", (*f as f32).to_bits());
        }
        for i in ints {
            want += &format!("{i}\n");
        }
        want += "1\n";
        assert_eq!(got, want, "{src}");
    }
}
