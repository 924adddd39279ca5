//! Test directives from a test patch, as SWE-bench's harness derives them
//! (`get_test_directives`): every file the patch changes that is not data or docs; for
//! django, as a test label (`tests/forms_tests/tests/test_forms.py` →
//! `forms_tests.tests.test_forms`), for the others, the path as it is.

use crate::spec::{SpecError, non_test_exts};

/// The directives of `test_patch` for an instance of `repo`, in the patch's order.
pub fn test_directives(repo: &str, test_patch: &str) -> Result<Vec<String>, SpecError> {
    let skip = non_test_exts()?;
    Ok(test_patch
        .lines()
        .filter_map(changed_file)
        .filter(|path| !skip.iter().any(|ext| path.ends_with(ext.as_str())))
        .map(|path| match repo {
            "django/django" => django_label(path),
            _ => path.to_owned(),
        })
        .collect())
}

/// The new side of a `diff --git a/X b/Y` line. The harness matches `a/.* b/(.*)`, whose
/// greedy first part takes the last ` b/`; so does this.
fn changed_file(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("diff --git a/")?;
    let (_, new) = rest.rsplit_once(" b/")?;
    Some(new)
}

fn django_label(path: &str) -> String {
    let path = path.strip_suffix(".py").unwrap_or(path);
    let path = path.strip_prefix("tests/").unwrap_or(path);
    path.replace('/', ".")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patch(paths: &[&str]) -> String {
        paths
            .iter()
            .map(|p| format!("diff --git a/{p} b/{p}\n--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-x\n+y\n"))
            .collect()
    }

    #[test]
    fn django_paths_become_test_labels() {
        let p = patch(&[
            "tests/forms_tests/tests/test_forms.py",
            "tests/forms_tests/widget_tests/test_fileinput.py",
            "tests/postgres_tests/test_array.py",
        ]);
        assert_eq!(
            test_directives("django/django", &p).unwrap(),
            [
                "forms_tests.tests.test_forms",
                "forms_tests.widget_tests.test_fileinput",
                "postgres_tests.test_array"
            ]
        );
    }

    #[test]
    fn other_repositories_keep_paths_and_data_files_are_left_out() {
        let p = patch(&[
            "tests/test_pycode_ast.py",
            "tests/roots/test-ext-autodoc/target/x.py",
            "tests/roots/test-root/conf.txt",
            "tests/data.json",
            "tests/table.csv",
        ]);
        assert_eq!(
            test_directives("sphinx-doc/sphinx", &p).unwrap(),
            [
                "tests/test_pycode_ast.py",
                "tests/roots/test-ext-autodoc/target/x.py"
            ]
        );
    }

    #[test]
    fn the_new_side_of_a_rename_is_taken() {
        let p = "diff --git a/tests/old_test.py b/tests/new_test.py\nsimilarity index 90%\n";
        assert_eq!(
            test_directives("pytest-dev/pytest", p).unwrap(),
            ["tests/new_test.py"]
        );
    }
}
